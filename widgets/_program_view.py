"""ProgramView: an LM program as it runs, fed by the interpreter's program events.

`view.on_event` (also `view.subscriber`) is called from executor threads: it only appends to a buffer. A Ticker
thread folds the buffer into per-program segment lists and syncs them to the frontend at <= 20 Hz, one
`hold_sync` message per flush. Everything the frontend shows lives in synced traits, so a saved notebook shows
the finished program with no kernel. The trait layout is documented in `program_view.js`.
"""

from __future__ import annotations

import functools
import math
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anywidget
import traitlets

from sgnb.widgets._esm import bundle
from sgnb.widgets._media import FRAME_PX, MAX_FRAMES, THUMB_PX, small_image
from sgnb.widgets._ticker import Ticker

Event = dict[str, Any]

# text that is a chat template's role marker rather than the user's words (shown muted)
_TEMPLATE_MARK = re.compile(r"<\|[^|>]{1,40}\|>|<s>|</s>|\[/?INST\]|<<SYS>>")
_META_KEYS = ("prompt_tokens", "completion_tokens", "cached_tokens", "finish_reason", "e2e_latency",
              "decode_steps", "forced_tokens")
MAX_TOKENS_SHOWN = 2000  # per gen; the token list is only kept for constrained / jump-forward gens


class _Program:
    """One executor's trace: the segments of its text in order (see program_view.js for their fields)."""

    def __init__(self, pid: str, parent: str | None) -> None:
        self.id, self.parent = pid, parent
        self.name = ""
        self.arguments: dict[str, str] = {}
        self.status = "running"
        self.segments: list[dict[str, Any]] = []
        self.variables: list[str] = []
        self.children: list[str] = []
        self.open_gen: dict[str, Any] | None = None
        self.open_gen_t = 0.0
        self.error: dict[str, Any] | None = None
        self.t_begin = time.time()
        self.t_end: float | None = None

    def to_json(self) -> dict[str, Any]:
        # fresh dicts: traitlets compares the new value with the last one sent, so nothing may be shared mutably
        return {"id": self.id, "parent": self.parent, "name": self.name, "arguments": self.arguments,
                "status": self.status, "segments": [dict(s) for s in self.segments],
                "variables": list(self.variables), "children": list(self.children), "error": self.error,
                "elapsed": round((self.t_end or time.time()) - self.t_begin, 3)}


def softmax(logprobs: list[float | None] | None) -> list[float | None]:
    """Probabilities of the choices from select's normalized prompt logprobs (None where a value is missing)."""
    if not logprobs:
        return []
    vals = [v if isinstance(v, (int, float)) and math.isfinite(v) else None for v in logprobs]
    finite = [v for v in vals if v is not None]
    if not finite:
        return [None] * len(vals)
    top = max(finite)
    exps = [math.exp(v - top) if v is not None else 0.0 for v in vals]
    total = sum(exps)
    return [round(e / total, 4) if v is not None else None for e, v in zip(exps, vals)]


class _hybridmethod:
    """`ProgramView.run(fn)` makes a new view; `view.run(fn)` uses that view."""

    def __init__(self, func: Callable[..., Any]) -> None:
        self.func = func
        functools.update_wrapper(self, func)  # type: ignore[arg-type]

    def __get__(self, obj: Any, cls: type) -> Callable[..., Any]:
        return functools.partial(self.func, cls, obj)


def _display(widget: Any) -> None:
    """Display in IPython (a notebook shows the widget, a terminal its text); do nothing in a plain script."""
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:
        return
    if get_ipython() is not None:
        display(widget)


class ProgramView(anywidget.AnyWidget):
    """Shows LM programs as they run: the prompt as it grows, generated spans per variable, forks side by side,
    select probabilities, constrained spans with forced (jump-forward) vs sampled tokens, images, per-gen
    cached tokens and timings.

    Feed it events: `fn.run(..., subscribers=[view.subscriber])`, or `view.run(fn, ...)` / `ProgramView.run(fn,
    ...)`. `on_event` is thread-safe and cheap; traits update at most `1 / interval` times a second, or at once
    with `flush()`. Several programs (run_batch, or successive runs) show one after another.
    """

    _esm = bundle("program_view.js")

    title = traitlets.Unicode("").tag(sync=True)
    programs = traitlets.List(traitlets.Dict()).tag(sync=True)
    summary = traitlets.Dict().tag(sync=True)

    def __init__(self, title: str = "", *, interval: float = 0.05, **kwargs: Any) -> None:
        super().__init__(title=title, **kwargs)
        self._lock = threading.Lock()  # guards _pending (appended from executor threads)
        self._flush_lock = threading.RLock()  # one flush at a time; guards the program model below
        self._pending: list[Event] = []
        self._programs: dict[str, _Program] = {}
        self.events_seen = 0
        self.flushes = 0  # flushes that sent something (each is one comm message)
        self._ticker = Ticker(self.flush, max(interval, 0.05), "sgnb-program-view", idle_stop=2.0)

    # ---- feeding -----------------------------------------------------------------------------------------
    def on_event(self, event: Event) -> None:
        """Take one program event (any thread). Only appends; the timer thread does the rest."""
        with self._lock:
            self._pending.append(event)
        self._ticker.start()

    @property
    def subscriber(self) -> Callable[[Event], None]:
        """The callable to pass as `fn.run(..., subscribers=[view.subscriber])`."""
        return self.on_event

    @_hybridmethod
    def run(cls, view: ProgramView | None, fn: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        """Run `fn` (an sgnb function) with a view subscribed; display the view; return the program state at
        once (it runs on; read variables or `state.sync()` to wait). `ProgramView.run(fn, ...)` creates and
        displays a new view (also at `state.view`); `view.run(fn, ...)` feeds an existing one."""
        if view is None:
            view = cls(title=getattr(fn, "__name__", ""))
            _display(view)
        subscribers = [*(kwargs.pop("subscribers", None) or []), view.on_event]
        state = fn.run(*args, subscribers=subscribers, **kwargs)
        try:
            state.view = view
        except AttributeError:
            pass
        return state

    def run_batch(self, fn: Any, batch_kwargs: list[dict[str, Any]], **kwargs: Any) -> list[Any]:
        """`fn.run_batch(batch_kwargs, ...)` with this view subscribed (blocks until all finish, like run_batch)."""
        subscribers = [*(kwargs.pop("subscribers", None) or []), self.on_event]
        states = fn.run_batch(batch_kwargs, subscribers=subscribers, **kwargs)
        self.flush()
        return states

    def close(self) -> None:
        self._ticker.stop()
        super().close()

    def clear(self) -> None:
        with self._flush_lock:
            with self._lock:
                self._pending.clear()
            self._programs.clear()
            self._send_model()

    # ---- folding events into the model -------------------------------------------------------------------
    def flush(self) -> bool:
        """Apply buffered events and sync the traits now (one message). Returns False when nothing was pending."""
        with self._flush_lock:
            with self._lock:
                events, self._pending = self._pending, []
            if not events:
                return False
            for event in events:
                self._apply(event)
            self.events_seen += len(events)
            self._send_model()
            return True

    def _send_model(self) -> None:
        programs = [p.to_json() for p in self._programs.values()]
        gens = [s for p in self._programs.values() for s in p.segments if s["k"] == "gen"]
        summary = {
            "programs": len(programs),
            "running": sum(p["status"] == "running" for p in programs),
            "errors": sum(p["status"] == "error" for p in programs),
            "gens": len(gens),
            "prompt_tokens": sum(g["meta"].get("prompt_tokens", 0) for g in gens),
            "cached_tokens": sum(g["meta"].get("cached_tokens", 0) for g in gens),
            "completion_tokens": sum(g["meta"].get("completion_tokens", 0) for g in gens),
            "events": self.events_seen,
        }
        with self.hold_sync():
            self.programs = programs
            self.summary = summary
        self.flushes += 1

    def _program(self, event: Event) -> _Program:
        pid = event.get("program") or "?"
        prog = self._programs.get(pid)
        if prog is None:
            prog = self._programs[pid] = _Program(pid, event.get("parent"))
            parent = self._programs.get(prog.parent) if prog.parent else None
            if parent is not None and pid not in parent.children:
                parent.children.append(pid)
        return prog

    def _apply(self, event: Event) -> None:
        handler = _HANDLERS.get(event.get("type", ""))
        if handler is not None:
            handler(self, self._program(event), event)

    def _program_begin(self, p: _Program, e: Event) -> None:
        p.name, p.arguments = e.get("name", ""), dict(e.get("arguments") or {})

    def _text(self, p: _Program, e: Event) -> None:
        text, var = e.get("text", ""), e.get("var")
        gen = p.open_gen
        if gen is not None:  # a gen's chunk (one per token run when streaming, one in all otherwise)
            if not gen["text"]:
                gen["ttft"] = round(time.time() - p.open_gen_t, 4)
            gen["text"] += text
            gen["chunks"] += 1
            return
        if var is not None:  # a select's choice arrives as text first, then the select event
            p.segments.append({"k": "select", "var": var, "text": text, "choices": []})
            return
        p.segments.append({"k": "text", "text": text, "tmpl": bool(_TEMPLATE_MARK.search(text))})

    def _gen_begin(self, p: _Program, e: Event) -> None:
        constraint = e.get("constraint")
        seg = {"k": "gen", "var": e.get("var"), "rid": e.get("rid"), "where": e.get("where"), "text": "",
               "constraint": str(constraint)[:300] if constraint else None, "done": False, "chunks": 0,
               "meta": {}, "tokens": None, "ttft": None, "elapsed": None}
        p.segments.append(seg)
        p.open_gen, p.open_gen_t = seg, time.time()

    def _gen_end(self, p: _Program, e: Event) -> None:
        seg = p.open_gen
        if seg is None or seg["rid"] != e.get("rid"):
            seg = next((s for s in reversed(p.segments) if s["k"] == "gen" and s["rid"] == e.get("rid")), None)
            if seg is None:
                return
        meta = dict(e.get("meta_info") or {})
        tokens = meta.pop("output_tokens", None) or []
        seg["meta"] = {k: meta[k] for k in _META_KEYS if k in meta}
        if tokens and (seg["constraint"] or any(f for _, f in tokens)):
            seg["tokens"] = [[str(t), bool(f)] for t, f in tokens[:MAX_TOKENS_SHOWN]]
        seg["done"] = True
        seg["elapsed"] = round(time.time() - p.open_gen_t, 4)
        p.open_gen = None

    def _select(self, p: _Program, e: Event) -> None:
        choice, var = e.get("choice", ""), e.get("var")
        seg = p.segments[-1] if p.segments else None
        if seg is None or not (seg["k"] == "select" and seg["var"] == var
                               or seg["k"] == "text" and var is None and seg["text"] == choice):
            seg = {"k": "select", "var": var, "text": choice}
            p.segments.append(seg)
        seg["k"] = "select"
        seg["var"] = var
        logprobs = e.get("normalized_prompt_logprobs") or []
        probs = softmax(logprobs)
        choices = list(e.get("choices") or [])
        seg["choices"] = [{"text": c, "logprob": logprobs[i] if i < len(logprobs) else None,
                           "p": probs[i] if i < len(probs) else None, "chosen": c == choice}
                          for i, c in enumerate(choices)]

    def _role_begin(self, p: _Program, e: Event) -> None:
        p.segments.append({"k": "role_begin", "role": e.get("role")})

    def _role_end(self, p: _Program, e: Event) -> None:
        p.segments.append({"k": "role_end", "role": e.get("role")})

    def _media(self, p: _Program, e: Event) -> None:
        # the event's own thumbnail / frames (any input form) when it has them, else what a readable path gives
        path = str(e.get("path") or "")
        thumb = small_image(e.get("thumbnail"), THUMB_PX) or small_image(path, THUMB_PX)
        given = list(e.get("frames") or [])
        if len(given) > MAX_FRAMES:  # evenly spread, first and last kept
            given = [given[round(i * (len(given) - 1) / (MAX_FRAMES - 1))] for i in range(MAX_FRAMES)]
        frames = [f for f in (small_image(x, FRAME_PX) for x in given) if f]
        name = Path(path).name[:80] if path and not path.startswith("data:") else ""
        p.segments.append({"k": e["type"], "path": path[:200], "name": name, "thumb": thumb, "frames": frames,
                           "num_frames": e.get("num_frames")})

    def _fork(self, p: _Program, e: Event) -> None:
        children = [str(c) for c in e.get("children") or []]
        p.segments.append({"k": "fork", "children": children})
        for c in children:
            if c not in p.children:
                p.children.append(c)

    def _var(self, p: _Program, e: Event) -> None:
        name = e.get("name")
        if name is not None and name not in p.variables:
            p.variables.append(name)

    def _error(self, p: _Program, e: Event) -> None:
        if p.status == "interrupted":
            return  # what the interrupt made fail next (the aborted request) is not another error
        p.error = {"message": str(e.get("message", ""))[:2000], "where": e.get("where")}
        p.segments.append({"k": "error", **p.error})
        p.status = "interrupted" if e.get("interrupted") else "error"
        p.t_end = time.time()
        if p.open_gen is not None:
            p.open_gen["done"] = True
            p.open_gen = None

    def _end(self, p: _Program, e: Event) -> None:
        if p.status == "running":
            p.status = "done"
        p.t_end = p.t_end or time.time()

    # ---- text forms --------------------------------------------------------------------------------------
    def __repr__(self) -> str:
        with self._flush_lock:
            progs = list(self._programs.values())
            gens = [s for p in progs for s in p.segments if s["k"] in ("gen", "select") and s.get("var")]
        status = ("running" if any(p.status == "running" for p in progs)
                  else "error" if any(p.status == "error" for p in progs) else "done" if progs else "empty")
        shown = ", ".join(f"{g['var']}={g['text'][:24]!r}" for g in gens[:3])
        more = f", +{len(gens) - 3}" if len(gens) > 3 else ""
        title = f"{self.title!r}, " if self.title else ""
        return f"<ProgramView {title}{len(progs)} program(s), {status}{': ' + shown + more if shown else ''}>"

    def _repr_mimebundle_(self, **kwargs: Any) -> tuple[dict, dict] | None:
        """The widget view plus a short text/plain (what a terminal prints); never text/html."""
        bundle = super()._repr_mimebundle_(**kwargs)
        if bundle is not None:
            bundle[0].pop("text/html", None)
        return bundle


_HANDLERS: dict[str, Callable[[ProgramView, _Program, Event], None]] = {
    "program_begin": ProgramView._program_begin,
    "text": ProgramView._text,
    "gen_begin": ProgramView._gen_begin,
    "gen_end": ProgramView._gen_end,
    "select": ProgramView._select,
    "role_begin": ProgramView._role_begin,
    "role_end": ProgramView._role_end,
    "image": ProgramView._media,
    "video": ProgramView._media,
    "fork": ProgramView._fork,
    "var": ProgramView._var,
    "error": ProgramView._error,
    "end": ProgramView._end,
}
