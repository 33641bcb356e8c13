"""What the magics show: the live widgets of `sgnb.widgets` in a notebook, plain text anywhere else.

The widgets are imported lazily and only when the shell is a kernel with a frontend; if `sgnb.widgets` (or
one of its names) is missing, or the shell is a terminal or a test shell, a text rendering stands in.
"""

from __future__ import annotations

import html
import importlib
import operator
from typing import Any


def in_notebook(shell: Any) -> bool:
    return getattr(shell, "kernel", None) is not None


def widget_class(name: str) -> Any:
    """`sgnb.widgets.<name>`, or None when the widgets package (or that name) is not there."""
    try:
        return getattr(importlib.import_module("sgnb.widgets"), name, None)
    except ImportError:
        return None


def live_view(name: str, *args: Any, keep_current: bool = False, **kwargs: Any) -> Any:
    """Display and return a live `sgnb.widgets.<name>(*args, **kwargs)`, or return None (caller falls back).
    Its output can be sent again with `refresh_view` (the final static snapshot, once its run is over); with
    `keep_current` (an engine's view, open across later cells) it is sent again after each later cell that
    changed it, so a saved notebook keeps the latest picture (`sgnb.widgets._display.keep_current`)."""
    cls = widget_class(name)
    if cls is None:
        return None
    from sgnb.widgets._display import keep_current as keep
    from sgnb.widgets._display import show

    view = cls(*args, **kwargs)
    show(view)
    # the engine views: RadixTreeView flushes its events, EngineStats polls the engine; both count their syncs
    catch_up = getattr(cls, "flush", None) or getattr(cls, "poll", None)
    if keep_current and catch_up is not None and hasattr(view, "flushes"):
        keep(view, catch_up, operator.attrgetter("flushes"))
    return view


def discard_view(view: Any) -> None:
    """Take back a view displayed for a run that was refused before it began."""
    from sgnb.widgets._display import discard

    discard(view)


def refresh_view(view: Any) -> None:
    """Send `view`'s output again, with its snapshot of now: what a notebook saved after the cell keeps."""
    from sgnb.widgets._display import refresh

    refresh(view)


class Text:
    """Plain text for a notebook output (preformatted in HTML)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        return {"text/plain": self.text, "text/html": f"<pre>{html.escape(self.text)}</pre>"}

    def __repr__(self) -> str:
        return self.text


class LoadProgress:
    """What `%sgl model` shows while the engine starts: each phase as it begins, then with its time. In a
    notebook one output updated in place; elsewhere a line per finished phase. Call it as the engine's
    `progress(label, seconds)`; a label reported twice adds up on one line."""

    def __init__(self, title: str, live: bool) -> None:
        self.title = title
        self.phases: dict[str, float | None] = {}  # label -> seconds (None while it runs)
        self.handle: Any = None
        if live:
            from IPython.display import display

            self.handle = display(Text(self.render()), display_id=True)

    def __call__(self, label: str, seconds: float | None) -> None:
        if seconds is None:
            self.phases.setdefault(label, None)  # a phase seen before keeps its time meanwhile
        else:
            again = self.phases.get(label) is not None
            self.phases[label] = (self.phases.get(label) or 0.0) + seconds
            if self.handle is None and not again:
                print(f"  {label}: {seconds:.1f} s", flush=True)
        if self.handle is not None:
            self.handle.update(Text(self.render()))

    def render(self, summary: str | None = None) -> str:
        lines = [self.title]
        for label, seconds in self.phases.items():
            lines.append(f"  {label}: " + ("..." if seconds is None else f"{seconds:.1f} s"))
        if summary:
            lines.append(summary)
        return "\n".join(lines)

    def finish(self, summary: str) -> None:
        if self.handle is not None:
            self.handle.update(Text(self.render(summary)))
        else:
            print(summary)


def transcript(state: Any, max_chars: int = 4000) -> Text:
    """A finished program as text: what it wrote (the end of it, if long) and its variables."""
    exe = state.executor
    text = exe.text_ if len(exe.text_) <= max_chars else "..." + exe.text_[-max_chars:]
    lines = [text.rstrip("\n")]
    if exe.variables:
        lines.append("")
        lines += [f"{k} = {_short(v)}" for k, v in exe.variables.items()]
    return Text("\n".join(lines))


def variables_summary(state: Any) -> Text:
    exe = state.executor
    return Text("\n".join(f"{k} = {_short(v)}" for k, v in exe.variables.items()))


def tree_text(engine: Any, max_nodes: int = 60) -> Text:
    """The radix tree as an indented outline: tokens, locks, hits and the start of each node's text (labelled as
    the widget and the lab panel label it: an image reads "[image]", followed by its hash and tokens)."""
    from sgnb.widgets._media import key_label

    snap = engine.tree_snapshot(max_key_tokens=0)  # structure; the labels of the lines shown are made below
    nodes = snap["nodes"]
    children: dict[Any, list[dict]] = {}
    for n in nodes:
        children.setdefault(n["parent"], []).append(n)
    lines = [f"radix tree: {len(nodes) - 1} nodes, {snap['total_tokens']} tokens "
             f"({snap['evictable_tokens']} evictable, {snap['protected_tokens']} locked)"]

    def walk(node: dict, depth: int) -> None:
        if len(lines) > max_nodes:
            return
        if node["parent"] is not None:
            lock = f", locked x{node['lock_ref']}" if node["lock_ref"] else ""
            key = engine.node_key(node["id"])
            text, media = key_label(engine, key, 16, px=None) if key is not None else ("", [])
            held = "".join(f" ({m['kind']} {m['hash']}, {m['tokens']} tok)" for m in media)
            lines.append(f"{'  ' * depth}- [{node['tokens']} tok, {node['hit_count']} hits{lock}] {text!r}{held}")
        for child in children.get(node["id"], []):
            walk(child, depth + (node["parent"] is not None))

    for root in children.get(None, []):
        walk(root, 0)
    if len(lines) > max_nodes:
        lines.append("  ...")
    return Text("\n".join(lines))


def stats_text(engine: Any) -> Text:
    s = engine.get_stats()
    return Text(
        f"{s['model']} on {s['device']}: {s['running']} running, {s['waiting']} waiting, "
        f"{s['requests_finished']} finished, {s['requests_aborted']} aborted\n"
        f"cache hit rate {s['cache_hit_rate']:.1%} ({s['cached_tokens']} of {s['prompt_tokens']} prompt tokens); "
        f"{s['prefill_tokens']} prefilled, {s['generated_tokens']} generated in {s['decode_steps']} decode steps\n"
        f"KV pool {s['kv_total']} tokens: {s['kv_free']} free, {s['kv_cached']} cached "
        f"({s['kv_evictable']} evictable, {s['kv_protected']} locked)")


def _short(value: Any, limit: int = 200) -> str:
    r = repr(value)
    return r if len(r) <= limit else r[:limit] + "..."
