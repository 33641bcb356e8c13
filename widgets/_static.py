"""Static snapshots of the views: escaped HTML drawn from a view's synced traits, for whatever cannot run the widget
(GitHub, nbviewer, VS Code or JupyterLab without the widget manager, an exported page with scripts off).

One function per view draws it from the traits the frontend draws from (the trait layouts are documented at the top
of `program_view.js` and `radix_tree_draw.js`, and in `stats_draw.js`):

- `program_html(title, programs, summary)`: each program's text with its gens and selects marked, forks side by
  side, and one table of the gens' numbers per program;
- `tree_html(nodes, summary)`: the radix tree as indented rows (text, tokens, hits, in use, state);
- `stats_html(stats, history)`: the stats card's numbers, with small SVG sparklines;
- `batch_html(title, columns, rows, summary)`: a run_batch's table, one row per program (status, arguments,
  variables, progress), under the batch's counts.

`snapshot_html(state)` picks the one for a widget's state (by its `_anywidget_id`: a live widget's traits, or the
state a saved notebook keeps under `metadata.widgets`) and returns None for any other widget. The views'
`_repr_mimebundle_` puts the snapshot under `text/html` beside the widget (`with_snapshot`). A view displayed
before its run (a `%%sgl` cell's, a run_batch's) sends its output again when the run is over (`_display.py`), so
a notebook saved from JupyterLab keeps the final picture; and `sgnb.export.add_static_views` redraws every
snapshot from the saved widget state when a notebook is executed or written.

Only inline styles and plain tags (tables, pre, details, sup): GitHub drops `<style>` and classes, so the
snapshot must read well with no CSS at all. Every text goes through `html.escape`; images only as data: URLs.
"""

from __future__ import annotations

import html
import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

MAX_DEPTH = 32  # nested forks drawn
LABEL_CHARS = 80  # of a tree node's text, in its row
_FONT = "font-family: system-ui, sans-serif; font-size: 12px"
_MONO = ("margin: 0; white-space: pre-wrap; word-break: break-word; "
         "font: 12.5px/1.5 ui-monospace, SFMono-Regular, Menlo, monospace")
_MUTED = "color: #6e7781"
_CELL = "padding: 1px 7px; border-bottom: 1px solid #e5e7eb"
_STATUS = {"running": "#2764d8", "done": "#1f9d3a", "error": "#d93025", "interrupted": "#b06000"}
_STATE_COLOUR = {"new": "#1f9d3a", "hit": "#2764d8", "evicted": "#d93025"}


def _e(value: Any) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def _hue(name: Any) -> int:
    """The hue of a variable's colour: the same as program_view.js's, so both pictures agree."""
    h = 0
    for ch in str("" if name is None else name):
        h = (h * 31 + ord(ch)) % 360
    return h


def _num(x: Any, digits: int = 2) -> str:
    return f"{x:.{digits}f}" if isinstance(x, (int, float)) and not isinstance(x, bool) else ""


def _image(url: Any, height: int, alt: str) -> str:
    if not (isinstance(url, str) and url.startswith("data:image/")):
        return ""
    return f'<img src="{_e(url)}" alt="{_e(alt)}" height="{height}" style="vertical-align: middle">'


def _table(head: Sequence[str], rows: Sequence[Sequence[str]], style: str = "", align: str = "") -> str:
    """A table of already escaped cells; `align` has one letter per column, l or r (default: the first column
    left, the others right)."""
    width = max([len(head), *map(len, rows)])
    sides = ["left" if (align[i] if i < len(align) else "lr"[i > 0]) == "l" else "right" for i in range(width)]
    opening = {tag: [f'<{tag} style="{_CELL}; text-align: {side}">' for side in sides] for tag in ("th", "td")}

    def row(cells: Sequence[str], tag: str) -> str:
        close = f"</{tag}>"
        return "<tr>" + "".join(o + c + close for o, c in zip(opening[tag], cells)) + "</tr>"

    # margin-left: 0: JupyterLab's rendered HTML centres tables that say nothing of their margins
    return (f'<table style="border-collapse: collapse; font-size: 11px; margin-left: 0; {style}">'
            + row([_e(h) for h in head], "th") + "".join(row(r, "td") for r in rows) + "</table>")


# ---- ProgramView ---------------------------------------------------------------------------------------------
class _Body:
    """A program's body as HTML: runs of text go in <pre> blocks, roles and forks are blocks between them."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.in_pre = False

    def inline(self, markup: str) -> None:
        if not self.in_pre:
            self.parts.append(f'<pre style="{_MONO}">')
            self.in_pre = True
        self.parts.append(markup)

    def block(self, markup: str) -> None:
        if self.in_pre:
            self.parts.append("</pre>")
            self.in_pre = False
        self.parts.append(markup)

    def html(self) -> str:
        self.block("")
        return "".join(self.parts)


def _var_tag(var: Any) -> str:
    if var is None:
        return ""
    return (f'<sup style="background: hsl({_hue(var)} 55% 42%); color: #fff; border-radius: 3px; padding: 0 3px; '
            f'font: 600 9.5px system-ui, sans-serif">{_e(var)}</sup>')


def _gen_title(seg: Mapping[str, Any]) -> str:
    m = seg.get("meta") or {}
    lines = [f"{seg.get('var') or '(unnamed gen)'}"]
    if seg.get("constraint"):
        lines.append(f"constraint: {seg['constraint']}")
    if "prompt_tokens" in m:
        lines.append(f"prompt {m['prompt_tokens']} tok ({m.get('cached_tokens', 0)} cached)")
    if "completion_tokens" in m:
        lines.append(f"completion {m['completion_tokens']} tok")
    return "\n".join(lines)


def _marked(seg: Mapping[str, Any], text: str) -> str:
    h = _hue(seg.get("var"))
    return (f'<b style="background: hsl({h} 80% 90%); border-bottom: 2px solid hsl({h} 55% 45%); color: #1f2328; '
            f'font-weight: normal" title="{_e(_gen_title(seg))}" data-var="{_e(seg.get("var") or "")}">'
            f"{_e(text)}</b>")


def think_label(think: Mapping[str, Any]) -> str:
    """A reasoning block's summary, as program_view.js's thinkLabel writes it: "thought for 412 tokens, 3.1 s"."""
    n = think.get("tokens") or 0
    seconds = think.get("seconds")
    timed = f", {seconds:.1f} s" if isinstance(seconds, (int, float)) else ""
    return f"thought for {n} token{'' if n == 1 else 's'}{timed}"


def _think(seg: Mapping[str, Any], think: Mapping[str, Any]) -> str:
    """A gen's reasoning as a <details> block, folded."""
    return (f'<details data-think="{_e(seg.get("var") or "")}" style="margin: 2px 0; padding: 1px 6px; '
            f'border-left: 3px solid hsl({_hue(seg.get("var"))} 55% 45%); background: #f6f7f9">'
            f'<summary style="{_FONT}; font-size: 11px; {_MUTED}">{_e(think_label(think))}</summary>'
            f'<pre style="{_MONO}; {_MUTED}; font-style: italic">{_e(think.get("text"))}</pre></details>')


def _choices(seg: Mapping[str, Any]) -> str:
    items = []
    for c in seg.get("choices") or []:
        p = c.get("p")
        share = f" {round(p * 100)}%" if isinstance(p, (int, float)) else ""
        item = _e(json.dumps(c.get("text", ""), ensure_ascii=False) + share)
        items.append(f"<b>{item}</b>" if c.get("chosen") else item)
    return f' <small style="{_MUTED}">[{", ".join(items)}]</small>' if items else ""


def _media(seg: Mapping[str, Any]) -> str:
    name = seg.get("name") or seg.get("path") or seg.get("k")
    what = f"[{seg.get('k')}] {name}" + (f" ({seg['num_frames']} frames)" if seg.get("num_frames") else "")
    frames = [f for f in (_image(u, 36, "") for u in seg.get("frames") or []) if f]
    if seg.get("k") == "video" and frames:
        return f'<span title="{_e(what)}">{"".join(frames)}</span> <small>{_e(what)}</small>'
    return _image(seg.get("thumb"), 48, what) or f"<code>{_e(what)}</code>"


def _gens_table(segments: Sequence[Mapping[str, Any]]) -> str:
    rows = []
    for g in segments:
        select = g.get("k") == "select" and "meta" in g  # scored, not generated: its prompt and cache hits
        if g.get("k") != "gen" and not select:
            continue
        m = g.get("meta") or {}
        finish = "select" if select else m.get("finish_reason")
        if isinstance(finish, Mapping):
            finish = finish.get("type", json.dumps(finish))
        rows.append([_e(g.get("var") or ("(select)" if select else "(gen)")), _e(m.get("prompt_tokens", "")), _e(m.get("cached_tokens", "")),
                     _e(m.get("completion_tokens", "")), _num(m.get("e2e_latency", g.get("elapsed")), 3),
                     _e(finish if finish is not None else ("" if g.get("done") else "running"))])
    if not rows:
        return ""
    return _table(["variable", "prompt tok", "cached", "completion tok", "latency s", "finish"], rows,
                  "margin: 2px 0 4px")


def _program(prog: Mapping[str, Any], by_id: Mapping[Any, Mapping[str, Any]], depth: int) -> str:
    status = str(prog.get("status") or "")
    name = prog.get("name") or (f"branch {prog.get('id')}" if prog.get("parent") else prog.get("id"))
    args = ", ".join(f"{k}={v}" for k, v in (prog.get("arguments") or {}).items())
    head = (f'<div style="{_FONT}; background: #f3f4f6; padding: 2px 6px"><b>{_e(name)}</b> · '
            f'<b style="color: {_STATUS.get(status, "#444")}">{_e(status)}</b>'
            + (f' · {_num(prog["elapsed"])} s' if _num(prog.get("elapsed")) else "")
            + (f' · <span style="{_MUTED}">{_e(args)}</span>' if args else "") + "</div>")
    body = _Body()
    open_roles = 0
    for seg in prog.get("segments") or []:
        k = seg.get("k")
        if k == "text":
            text = _e(seg.get("text"))
            body.inline(f'<span style="{_MUTED}">{text}</span>' if seg.get("tmpl") else text)
        elif k == "gen":
            constraint = seg.get("constraint")
            chip = (f'<small style="{_MUTED}" title="{_e(constraint)}">[constrained] </small>' if constraint else "")
            text, think = str(seg.get("text") or ""), seg.get("think")
            if isinstance(think, Mapping) and think.get("end"):  # its reasoning folded, then the answer
                body.block(_think(seg, think))
                text = text[int(think["end"]):]
            body.inline(_var_tag(seg.get("var")) + chip + _marked(seg, text))
        elif k == "select":
            body.inline(_var_tag(seg.get("var")) + _marked(seg, str(seg.get("text") or "")) + _choices(seg))
        elif k == "role_begin":
            body.block(f'<div style="border-left: 3px solid #aaa; margin: 3px 0; padding: 1px 0 1px 7px">'
                       f'<div style="{_FONT}; font-size: 10px; {_MUTED}"><b>{_e(str(seg.get("role")).upper())}</b>'
                       "</div>")
            open_roles += 1
        elif k == "role_end" and open_roles:
            body.block("</div>")
            open_roles -= 1
        elif k in ("image", "video"):
            body.inline(_media(seg))
        elif k == "fork":
            children = [by_id[c] for c in seg.get("children") or [] if c in by_id]
            if children and depth < MAX_DEPTH:
                cells = "".join(f'<td style="vertical-align: top; padding: 0 3px 0 0">{_program(c, by_id, depth + 1)}'
                                "</td>" for c in children)
                body.block(f'<table style="border-collapse: collapse; margin: 3px 0"><tr>{cells}</tr></table>')
        elif k == "prior":
            body.block(f'<details><summary style="{_FONT}; {_MUTED}">continues {_e(seg.get("from"))}: '
                       f'{_e(seg.get("chars"))} characters before</summary><pre style="{_MONO}; {_MUTED}">'
                       f'{_e(seg.get("text"))}</pre></details>')
        elif k == "error":
            where = f"\n  at {seg['where']}" if seg.get("where") else ""
            text = f"error: {seg.get('message')}{where}"
            if seg.get("below"):  # the cell's traceback, under the view, has the message
                kind = re.match(r"([A-Za-z_][\w.]*):", str(seg.get("message") or ""))
                text = f"failed here{f' ({kind.group(1)})' if kind else ''}: the traceback is below"
            body.block(f'<pre style="{_MONO}; color: #a4161a; background: #fde7e9; padding: 2px 6px">'
                       f'{_e(text)}</pre>')
    body.block("</div>" * open_roles)
    colour = _STATUS.get(status, "#d0d7de") if status in ("running", "error") else "#d0d7de"
    return (f'<div style="border: 1px solid {colour}; border-radius: 6px; margin: 4px 0; overflow: hidden">'
            f'{head}<div style="padding: 4px 8px">{body.html()}{_gens_table(prog.get("segments") or [])}</div></div>')


def program_html(title: str, programs: Sequence[Mapping[str, Any]], summary: Mapping[str, Any]) -> str:
    """A ProgramView's picture: its title and summary, then each top-level program (forks inside)."""
    by_id = {p.get("id"): p for p in programs}
    n = summary.get("programs", len(programs))
    parts = [f"{n} program{'' if n == 1 else 's'}"]
    if summary.get("running"):
        parts.append(f"{summary['running']} running")
    if summary.get("errors"):
        parts.append(f"{summary['errors']} failed")
    gens = summary.get("gens")
    if gens:
        parts.append(f"{gens} gen{'' if gens == 1 else 's'}: {summary.get('prompt_tokens', 0)} prompt tok "
                     f"({summary.get('cached_tokens', 0)} cached), {summary.get('completion_tokens', 0)} generated")
    head = (f"<b>{_e(title)}</b> " if title else "") + f'<span style="{_MUTED}">{_e(" · ".join(parts))}</span>'
    tops = [_program(p, by_id, 0) for p in programs if not p.get("parent") or p.get("parent") not in by_id]
    body = "".join(tops) or f'<div style="{_MUTED}">(waiting for a program)</div>'
    return f'<div class="sgnb-static sgnb-static-program" style="{_FONT}"><div>{head}</div>{body}</div>'


# ---- RadixTreeView -------------------------------------------------------------------------------------------
def _short(text: str) -> str:
    if text and not text.strip():  # blanks alone: each space reads ␣ (the widget's marker), not an empty cell
        text = re.sub(r"[^\S\n\t]", "\u2423", text)
    text = text.replace("\n", "\\n")
    return text if len(text) <= LABEL_CHARS else text[: LABEL_CHARS - 3] + "..."


def tree_html(nodes: Sequence[Mapping[str, Any]], summary: Mapping[str, Any]) -> str:
    """A RadixTreeView's picture: one row per node (indented by depth; parents come first) and per "+N" group."""
    depth: dict[Any, int] = {}
    rows = []
    for r in nodes:
        d = depth[r.get("id")] = depth.get(r.get("parent"), -1) + 1 if r.get("parent") is not None else 0
        indent = "&nbsp;" * (3 * d)
        state = str(r.get("state") or "")
        mark = f'<b style="color: {_STATE_COLOUR[state]}">{state}</b>' if state in _STATE_COLOUR else ""
        if r.get("group"):
            label = (f'<i>+{_e(r.get("count"))} nodes</i> <span style="{_MUTED}">({_e(r.get("children"))} '
                     "children, not shown)</span>")
            rows.append([indent + label, _e(r.get("tokens")), "", "", mark])
            continue
        if r.get("parent") is None:
            label = "<b>root</b>"
        else:
            chips = "".join(_image(m.get("thumbnail"), 16, f"[{m.get('kind')}]") for m in r.get("media") or [])
            text = str(r.get("text") or "")
            label = f'{chips}<code title="{_e(text)}">{_e(_short(text))}</code>'
        if r.get("think"):  # a model's thinking: all of the node or part of it (the tree view's italics)
            label += f' <i style="color: #8a4a86">({"reasoning" if r["think"] == "all" else "part reasoning"})</i>'
        if r.get("collapsed"):
            label += f' <span style="{_MUTED}">(+{_e(r.get("hidden", 0))} folded)</span>'
        elif r.get("below"):
            label += f' <span style="{_MUTED}">(+{_e(r["below"])} below, not shown)</span>'
        rows.append([indent + label, _e(r.get("tokens")), _e(r.get("hits")), "locked" if r.get("locked") else "",
                     mark])
    live = summary.get("nodes", len(nodes))
    line = (f"radix tree: {max(int(live or 0) - 1, 0)} nodes below the root, {summary.get('tokens', 0)} tokens "
            f"cached, {summary.get('locked', 0)} in use; {summary.get('finished', 0)} requests done")
    if summary.get("shown") and summary.get("shown") < live:
        line += f" (an overview: the {summary['shown']} largest or busiest shown)"
    table = _table(["node", "tokens", "hits", "in use", "state"], rows) if rows else ""
    return (f'<div class="sgnb-static sgnb-static-tree" style="{_FONT}"><div style="{_MUTED}">{_e(line)}</div>'
            f"{table}</div>")


# ---- EngineStats ---------------------------------------------------------------------------------------------
SPARK_W, SPARK_H = 132, 30
_SPARKS: dict[str, list[tuple[str, str, float | None]]] = {"cache hit rate": [("hit_rate", "#2764d8", 1.0)],
           "decode tokens/s": [("gen_tokens_per_s", "#1f9d3a", None), ("prefill_tokens_per_s", "#b26a00", None)],
           "KV pool": [("kv_used_frac", "#d93025", 1.0), ("kv_cached_frac", "#7b61ff", 1.0)],
           "queue": [("waiting", "#b26a00", None), ("running", "#1f9d3a", None)]}


def sparkline(series: Sequence[Sequence[float]], colours: Sequence[str], top: Sequence[float | None]) -> str:
    """An inline SVG of one polyline per series, each scaled to [0, its top] (its own maximum when None)."""
    lines = []
    for values, colour, fixed in zip(series, colours, top):
        vs = [float(v) if isinstance(v, (int, float)) else 0.0 for v in values or []]
        if not vs:
            continue
        if len(vs) == 1:  # one sample: a level line
            vs = vs * 2
        hi = fixed if fixed is not None else max(max(vs), 1e-9)
        step = SPARK_W / (len(vs) - 1) if len(vs) > 1 else 0.0
        points = " ".join(f"{i * step:.1f},{SPARK_H - 1 - min(v, hi) / hi * (SPARK_H - 2):.1f}"
                          for i, v in enumerate(vs))
        lines.append(f'<polyline points="{points}" fill="none" stroke="{colour}" stroke-width="1.5"/>')
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{SPARK_W}" height="{SPARK_H}">{"".join(lines)}</svg>'
            if lines else "")


def _last_active(values: Sequence[float] | None) -> float:
    return next((v for v in reversed(values or []) if isinstance(v, (int, float)) and v > 0), 0.0)


def _rate(x: Any) -> str:
    v = float(x or 0)
    return str(round(v)) if v >= 100 else f"{v:.1f}"


def stats_html(stats: Mapping[str, Any], history: Mapping[str, Sequence[float]]) -> str:
    """An EngineStats card: hit rate, throughput, KV pool and queues (the latest numbers) with their sparklines."""
    s, h = stats, history
    decode = float(s.get("gen_tokens_per_s") or 0)
    prefill = float(s.get("prefill_tokens_per_s") or 0)
    used, total = int(s.get("kv_used") or 0), int(s.get("kv_total") or 0)
    tiles = {
        "cache hit rate": (f"{round(100 * float(s.get('cache_hit_rate') or 0))}%",
                           f"since start ({s.get('cached_tokens', 0)} of {s.get('prompt_tokens', 0)} prompt tokens "
                           "cached); the line: at each update"),
        "decode tokens/s": (_rate(decode) if decode > 0 else f"idle (last {_rate(_last_active(h.get('gen_tokens_per_s')))})",
                            f"prefill {_rate(prefill or _last_active(h.get('prefill_tokens_per_s')))} tok/s"
                            + ("" if prefill > 0 else " (last)")),
        "KV pool": (f"{round(100 * used / max(total, 1))}% used",
                    f"{used}/{total} slots · {s.get('kv_cached', 0)} cached ({s.get('kv_evictable', 0)} evictable)"),
        "queue": (f"{s.get('waiting', 0)} waiting · {s.get('running', 0)} running",
                  f"{s.get('requests_finished', 0)} finished"),
    }
    rows = []
    for label, (value, note) in tiles.items():
        spark = _SPARKS[label]
        svg = sparkline([h.get(name) or [] for name, _, _ in spark], [c for _, c, _ in spark], [t for *_, t in spark])
        rows.append([_e(label), f"<b>{_e(value)}</b>", f'<span style="{_MUTED}">{_e(note)}</span>', svg])
    foot = (f"model {s.get('model', '?')} on {s.get('device', '?')} · {s.get('requests_aborted', 0)} aborted · "
            f"{s.get('retractions', 0)} retractions · {s.get('decode_steps', 0)} decode steps")
    return (f'<div class="sgnb-static sgnb-static-stats" style="{_FONT}">'
            f'{_table(["engine", "now", "", "history"], rows, align="lrll")}<div style="{_MUTED}">{_e(foot)}</div></div>')


# ---- BatchView -----------------------------------------------------------------------------------------------
_BATCH_STATUS = {**_STATUS, "cancelled": "#b06000", "queued": "#6e7781"}
BATCH_ERROR_CHARS = 120  # of a failed row's error, under its status


def batch_html(title: str, columns: Sequence[str], rows: Sequence[Mapping[str, Any]],
               summary: Mapping[str, Any]) -> str:
    """A BatchView's picture: the batch's counts, then one table row per program (its number, status, the
    argument and variable columns, gens done of begun, tokens, seconds), as batch_view.js draws it; a failed
    row's error under its status. While every program is still queued, the counts alone (the snapshot a
    run_batch's table goes out with, replaced when it ends)."""
    s = summary
    nargs = int(s.get("arguments") or 0)
    finished = sum(int(s.get(k) or 0) for k in ("done", "error", "interrupted"))
    parts = [f"{finished}/{s.get('total', len(rows))} finished"]
    if s.get("running"):
        parts.append(f"{s['running']} running")
    if s.get("error"):
        parts.append(f"{s['error']} failed")
    stopped = int(s.get("interrupted") or 0) + int(s.get("cancelled") or 0)
    if stopped:
        parts.append(f"{stopped} interrupted")
    parts += [f"{s.get('gens', 0)} gens, {s.get('tokens', 0)} tokens", f"{_num(s.get('elapsed') or 0.0, 1)} s"]
    head = (f"<b>run_batch{': ' + _e(title) if title else ''}</b> "
            f'<span style="{_MUTED}">{_e(" · ".join(parts))}</span>')
    body = []
    queued = all(r.get("status") == "queued" for r in rows)  # nothing began yet: the counts say it all
    for r in ([] if queued else rows):
        status = str(r.get("status") or "")
        cell = f'<b style="color: {_BATCH_STATUS.get(status, "#444")}">{_e(status)}</b>'
        error = str(r.get("error") or "")
        if error:
            short = error if len(error) <= BATCH_ERROR_CHARS else error[: BATCH_ERROR_CHARS - 3] + "..."
            cell += f'<br><small style="color: #a4161a" title="{_e(error)}">{_e(short)}</small>'
        values = [(r.get("arguments") if j < nargs else r.get("values")) or {} for j in range(len(columns))]
        cells = [f"<code>{_e(v.get(c, ''))}</code>" if v.get(c) else "" for v, c in zip(values, columns)]
        gens = f"{r.get('gens_done', 0)}/{r['gens']}" if r.get("gens") else ""
        body.append([_e(r.get("i")), cell, *cells, _e(gens), _e(r.get("tokens") or ""), _num(r.get("elapsed"), 2 if (r.get("elapsed") or 0) < 10 else 1)])
    table = _table(["#", "status", *columns, "gens", "tokens", "s"], body, align="rl" + "l" * len(columns) + "rrr")
    if body:  # a box of the live table's height (batch_view.js) that scrolls, not a page of rows
        table = f'<div style="max-height: 340px; overflow: auto; margin-top: 3px">{table}</div>'
    else:
        table = ""
    more = 0 if queued else int(s.get("total") or 0) - len(rows)
    note = (f'<div style="{_MUTED}">... {more} more program{"" if more == 1 else "s"} (counted above, not '
            "listed)</div>" if more > 0 else "")
    return f'<div class="sgnb-static sgnb-static-batch" style="{_FONT}"><div>{head}</div>{table}{note}</div>'


# ---- choosing the snapshot -----------------------------------------------------------------------------------
# a view's class name -> (its snapshot function, the traits it takes, in order)
_VIEWS: dict[str, tuple[Callable[..., str], tuple[str, ...]]] = {
    "ProgramView": (program_html, ("title", "programs", "summary")),
    "RadixTreeView": (tree_html, ("nodes", "summary")),
    "EngineStats": (stats_html, ("stats", "history")),
    "BatchView": (batch_html, ("title", "columns", "rows", "summary")),
}
_DEFAULTS: dict[str, Any] = {"title": "", "programs": [], "nodes": [], "summary": {}, "stats": {}, "history": {},
                             "columns": [], "rows": []}


def _draw(kind: str, get: Callable[[str], Any]) -> str:
    draw, traits = _VIEWS[kind]
    return draw(*[get(name) if get(name) is not None else _DEFAULTS[name] for name in traits])


def snapshot_html(state: Mapping[str, Any]) -> str | None:
    """The snapshot of the sgnb view whose synced state this is (its traits by name), or None for another widget."""
    anywidget_id = str(state.get("_anywidget_id") or "")
    module, _, kind = anywidget_id.rpartition(".")
    if not module.startswith("sgnb.widgets") or kind not in _VIEWS:
        return None
    return _draw(kind, state.get)


def with_snapshot(widget: Any, bundle: tuple[dict, dict] | None) -> tuple[dict, dict] | None:
    """`bundle` (a widget's `_repr_mimebundle_`) with the widget's snapshot added under text/html."""
    kind = next((c.__name__ for c in type(widget).__mro__ if c.__name__ in _VIEWS), None)
    if bundle is None or kind is None:
        return bundle
    data, metadata = bundle
    try:
        data["text/html"] = _draw(kind, lambda name: getattr(widget, name, None))
    except Exception as e:  # a snapshot must never keep the widget from showing
        data["text/html"] = f"<pre>{_e(type(widget).__name__)}: no snapshot ({_e(type(e).__name__)}: {_e(e)})</pre>"
    return data, metadata


__all__ = ["batch_html", "program_html", "snapshot_html", "sparkline", "stats_html", "tree_html", "with_snapshot"]
