"""ProgramView: an LM program as it runs, fed by the interpreter's program events (sgnb.program_events).

`view.on_event` (also `view.subscriber`) is called from executor threads: it only appends to a buffer (with the
time it arrived: the wall-clock timings are the events' own, not the later flush's). A Ticker thread folds the
buffer into per-program segment lists and syncs them to the frontend at <= 20 Hz, one `hold_sync` message per
flush. Everything the frontend shows lives in synced traits, so a saved notebook shows the finished program with
no kernel. The trait layout is documented in `program_view.js`.

Timings: a gen's TTFT and latency are the engine's (`meta_info["ttft"]`, `["e2e_latency"]`: one clock, both from
the request's arrival at the engine), so TTFT <= latency; `elapsed` is the wall time from gen() to its result in
the program (it includes tokenizing, queueing and compiling a grammar). A backend that reports no TTFT gets the
wall time to the first streamed chunk, and none when the gen was not streamed (its first text is its result).
"""

from __future__ import annotations

import functools
import math
import re
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import anywidget
import traitlets

from sgnb.engine.meta_info import MetaInfo, meta_subset
from sgnb.program_events import (
    EndEvent,
    ErrorEvent,
    ForkEvent,
    GenBeginEvent,
    GenEndEvent,
    MediaEvent,
    ProgramBeginEvent,
    ProgramEvent,
    ReasoningEvent,
    RoleEvent,
    SelectEvent,
    Subscriber,
    TextEvent,
    VarEvent,
)
from sgnb.reasoning import ReasoningStream
from sgnb.widgets._esm import bundle
from sgnb.widgets._media import FRAME_PX, MAX_FRAMES, THUMB_PX, small_image
from sgnb.widgets._ticker import BATCH_INTERVAL, Ticker
from sgnb.widgets._tree_rows import CHAT_MARKER, has_marker

_META_KEYS = ("prompt_tokens", "completion_tokens", "cached_tokens", "finish_reason", "e2e_latency", "ttft",
              "decode_steps", "forced_tokens")
MAX_TOKENS_SHOWN = 2000  # per gen
MAX_ALTERNATIVES = 5  # top-k alternatives kept per token
MAX_PRIOR_CHARS = 4000  # of a continued state's earlier text, shown (collapsed) in a view that did not see it


class _Program:
    """One executor's trace: the segments of its text in order (see program_view.js for their fields)."""

    def __init__(self, pid: str, parent: str | None, now: float) -> None:
        self.id, self.parent = pid, parent
        self.name = ""
        self.arguments: dict[str, str] = {}
        self.status = "running"
        self.segments: list[dict[str, Any]] = []
        self.variables: list[str] = []
        self.children: list[str] = []
        self.open_gen: dict[str, Any] | None = None
        self.open_gen_t = 0.0
        self.thinking: ReasoningStream | None = None  # the open gen's split, when separate_reasoning wraps it
        self.thinking_fed = 0  # characters of the open gen fed to it
        self.thinking_closed_t: float | None = None  # when its answer began
        self.gen_start: dict[str, int] = {}  # a gen's rid -> where its text starts (in `chars`)
        self.first_chunk_t: float | None = None
        self.error: dict[str, Any] | None = None
        self.t_begin = now
        self.t_end: float | None = None
        # where the cached part of each gen's prompt ends, in characters (not synced): the program's text
        # length so far (a branch starts at its parent's length at the fork), its pieces (start, end, estimated
        # tokens), the text segments no gen has read yet with their start, and (characters, tokens) points
        # known from earlier gens' counts
        self.chars = 0
        self.pieces: list[tuple[int, int, int | str]] = []  # (a piece's text, estimated only when needed)
        self.unread: list[tuple[dict[str, Any], int]] = []
        self.fork_at: dict[str, int] = {}
        self.anchors: list[tuple[int, int]] = [(0, 0)]

    def advance(self, text: str, tokens: int | None = None) -> int:
        """The program's text grew by `text`: returns where it starts."""
        start = self.chars
        self.chars += len(text)
        if text:
            self.pieces.append((start, self.chars, text if tokens is None else tokens))
        return start

    def to_json(self) -> dict[str, Any]:
        # fresh dicts: traitlets compares the new value with the last one sent, so nothing may be shared mutably
        return {"id": self.id, "parent": self.parent, "name": self.name, "arguments": self.arguments,
                "status": self.status, "segments": [dict(s) for s in self.segments],
                "variables": list(self.variables), "children": list(self.children), "error": self.error,
                "elapsed": round((self.t_end or time.time()) - self.t_begin, 3)}


def softmax(logprobs: Sequence[float | None] | None) -> list[float | None]:
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


def _finite(x: Any) -> float | None:
    return round(float(x), 4) if isinstance(x, (int, float)) and math.isfinite(x) else None


def _piece(entry: Any) -> str:
    """The text of a logprob entry (logprob, id, text | None): its id when the backend sent no text."""
    if len(entry) > 2 and entry[2] is not None:
        return str(entry[2])
    return f"#{entry[1]}" if len(entry) > 1 else "?"


def align_tokens(text: str, pieces: list[str]) -> list[str] | None:
    """Each token's part of `text`, so that the parts concatenate to it: tokens past the text's end (a stop
    string, EOS) are dropped; a run of tokens holding one character's UTF-8 bytes (each reads U+FFFD) gives the
    character to the first and "" to the rest. None when the tokens do not read as the text."""
    out: list[str] = []
    pos, in_char = 0, False
    for t in pieces:
        if pos >= len(text) and not (in_char and t.startswith("\ufffd")):
            break
        if not t:  # a token that added no text
            out.append("")
            continue
        if in_char and t and "\ufffd" not in t:  # after bytes of characters: they end where this token reads
            j = text.find(t, pos, pos + 4 + len(t))
            if j > pos:
                out[-1] += text[pos:j]
                pos = j
        if t and text.startswith(t, pos):
            out.append(t)
            pos, in_char = pos + len(t), False
            continue
        k = t.find("\ufffd")
        if k < 0 or not text.startswith(t[:k], pos):
            return None
        if in_char and k == 0:  # more bytes of the character the previous token began
            out.append("")
            continue
        out.append(text[pos:pos + k + 1])
        pos, in_char = pos + k + 1, True
    if in_char and 0 < len(text) - pos <= 4:
        out[-1] += text[pos:]
        pos = len(text)
    return out if pos == len(text) else None


def token_detail(text: str, meta: MetaInfo) -> list[list[Any]] | None:
    """A gen's tokens for the view: [text, forced, logprob | None, [[alternative, logprob], ...] | None] each,
    from the backend's (text, forced) pairs (the engine's pieces join to the text and are taken as they are;
    other token texts are fitted to it) or else its logprob entries' token texts, and, when logprobs were asked
    for, its logprob lists (the texts of tokens the backend did not name read "#id"). None when the backend reported no
    tokens or they do not read as the text."""
    pairs = list(meta.get("output_tokens") or [])
    lps = list(meta.get("output_token_logprobs") or [])  # (logprob, id, text | None) per token
    tops = list(meta.get("output_top_logprobs") or [])  # a list of those (or None) per token
    if not pairs and lps:
        pairs = [(_piece(e), False) for e in lps]
    if not pairs:
        return None
    texts = [str(t) for t, _ in pairs]
    exact = "".join(texts) == text
    parts = texts if exact else align_tokens(text, texts)
    if parts is None:
        return None
    while exact and parts and not parts[-1]:  # the engine's pieces past the text's end (a stop string, EOS)
        parts.pop()
    out: list[list[Any]] = []
    for i, part in enumerate(parts[:MAX_TOKENS_SHOWN]):
        lp = _finite(lps[i][0]) if i < len(lps) and lps[i] else None
        top = tops[i] if i < len(tops) else None
        alts = [[_piece(a), _finite(a[0])] for a in top[:MAX_ALTERNATIVES]] if top else None
        out.append([part, bool(pairs[i][1]), lp, alts])
    return out


# a rough BPE: a word with its leading space, a digit, a run of spaces, any other character; a
# chat-template marker (with its role name) is one token
_TOKENISH = re.compile(CHAT_MARKER.pattern + r"| ?[A-Za-z]{1,10}|\d|\s+|[^\sA-Za-z\d]")


def estimate_tokens(text: str) -> int:
    """About how many tokens `text` is (the known counts around it scale the estimates): for backends that do
    not say where a cache hit ends in the prompt's characters (the engine's cached_chars)."""
    return len(_TOKENISH.findall(text))


def cached_chars(pieces: Sequence[tuple[int, int, int | str]], anchors: list[tuple[int, int]], prompt_chars: int,
                 prompt_tokens: int, cached_tokens: int) -> tuple[int, bool]:
    """Where the cached part of a prompt ends, in characters, from its token counts: exact at a known point
    (the start, an earlier gen's prompt or end), else between the known points around it, spreading their
    tokens over the text between them by its estimated tokens (`pieces`: (start, end, tokens or the piece's
    text, estimated here: only a backend that does not report cached_chars needs it)). Returns
    (characters, exact)."""
    points = sorted({*(a for a in anchors if a[0] <= prompt_chars and a[1] <= prompt_tokens),
                     (prompt_chars, prompt_tokens)})
    cached_tokens = max(0, min(cached_tokens, prompt_tokens))
    for chars, tokens in points:
        if tokens == cached_tokens:
            return chars, True
    below = max((a for a in points if a[1] < cached_tokens), key=lambda a: a[1], default=(0, 0))
    above = min((a for a in points if a[1] > cached_tokens), key=lambda a: a[1], default=below)
    if above[1] == below[1] or above[0] <= below[0]:
        return below[0], False
    between = [(max(a, below[0]), min(b, above[0]),
                (estimate_tokens(n) if isinstance(n, str) else n) * (min(b, above[0]) - max(a, below[0])) / (b - a))
               for a, b, n in pieces if a < above[0] and b > below[0] and b > a]
    total = sum(n for _, _, n in between)
    if not between or total <= 0:  # no text known there: by characters
        frac = (cached_tokens - below[1]) / (above[1] - below[1])
        return round(below[0] + frac * (above[0] - below[0])), False
    need = (cached_tokens - below[1]) * total / (above[1] - below[1])  # in estimated tokens
    for a, b, n in between:
        if need <= n:
            return round(a + (b - a) * need / n) if n else a, False
        need -= n
    return above[0], False


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
    """Shows LM programs as they run: the prompt as it grows (the part the cache served shaded), generated spans
    per variable with their tokens (forced by a grammar or sampled; probability and top alternatives on hover
    when the gen asked for logprobs), forks side by side or under tabs, select probabilities, images, and one
    table of each program's gens: tokens, cache hits, timings.

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
        self._pending: list[tuple[float, ProgramEvent]] = []  # (arrival time, event)
        self._programs: dict[str, _Program] = {}
        self._alias: dict[str, str] = {}  # a continuation's program id -> the program it continues here
        self._now = time.time()  # the arrival time of the event being applied
        self.errors_below = False  # True: a traceback under the view says what went wrong (%%sgl sets it)
        self.events_seen = 0
        self.flushes = 0  # flushes that sent something (each is one comm message)
        self._ticker = Ticker(self.flush, max(interval, 0.05), "sgnb-program-view", idle_stop=2.0)

    # ---- feeding -----------------------------------------------------------------------------------------
    def on_event(self, event: ProgramEvent) -> None:
        """Take one program event (any thread). Only appends; the timer thread does the rest."""
        now = time.time()
        with self._lock:
            self._pending.append((now, event))
        self._ticker.start()

    @property
    def subscriber(self) -> Subscriber:
        """The callable to pass as `fn.run(..., subscribers=[view.subscriber])`."""
        return self.on_event

    @_hybridmethod
    def run(cls, view: ProgramView | None, fn: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        """Run `fn` (an sgnb function) with a view subscribed; display the view; return the program state at
        once (it runs on; read variables or `state.sync()` to wait). `ProgramView.run(fn, ...)` creates and
        displays a new view (also at `state.view`); `view.run(fn, ...)` feeds an existing one. Gens stream into
        the view token by token unless `stream=False` is given."""
        kwargs.setdefault("stream", True)
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
        """`fn.run_batch(batch_kwargs, ...)` with this view subscribed (blocks until all finish, like run_batch).
        Meanwhile the view refreshes, and streamed gens come, at a batch's pace (`BATCH_INTERVAL`, unless
        `stream_interval_s=` says otherwise)."""
        subscribers = [*(kwargs.pop("subscribers", None) or []), self.on_event]
        kwargs.setdefault("stream_interval_s", BATCH_INTERVAL)
        own = self._ticker.interval
        self._ticker.interval = max(own, kwargs["stream_interval_s"] or 0.0)
        try:
            states = fn.run_batch(batch_kwargs, subscribers=subscribers, **kwargs)
        finally:
            self._ticker.interval = own
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
            self._alias.clear()
            self._send_model()

    # ---- folding events into the model -------------------------------------------------------------------
    def flush(self) -> bool:
        """Apply buffered events and sync the traits now (one message). Returns False when nothing was pending."""
        with self._flush_lock:
            with self._lock:
                events, self._pending = self._pending, []
            if not events:
                return False
            for self._now, event in events:
                self._apply(event)
            self.events_seen += len(events)
            self._send_model()
            return True

    def _send_model(self) -> None:
        programs = [p.to_json() for p in self._programs.values()]
        gens = [s for p in self._programs.values() for s in p.segments if s["k"] == "gen"]
        scored = gens + [s for p in self._programs.values() for s in p.segments if s["k"] == "select" and "meta" in s]
        summary = {
            "programs": len(programs),
            "running": sum(p["status"] == "running" for p in programs),
            "errors": sum(p["status"] == "error" for p in programs),
            "gens": len(gens),
            "selects": len(scored) - len(gens),
            "prompt_tokens": sum(g["meta"].get("prompt_tokens", 0) for g in scored),
            "cached_tokens": sum(g["meta"].get("cached_tokens", 0) for g in scored),
            "completion_tokens": sum(g["meta"].get("completion_tokens", 0) for g in gens),
            "events": self.events_seen,
        }
        with self.hold_sync():
            self.programs = programs
            self.summary = summary
        self.flushes += 1

    def _program(self, event: ProgramEvent) -> _Program:
        pid = event.get("program") or "?"
        pid = self._alias.get(pid, pid)
        prog = self._programs.get(pid)
        if prog is None:
            prog = self._programs[pid] = _Program(pid, event.get("parent"), self._now)
            parent = self._programs.get(prog.parent) if prog.parent else None
            if parent is not None:
                if pid not in parent.children:
                    parent.children.append(pid)
                prog.chars = parent.fork_at.get(pid, parent.chars)
                prog.anchors = [a for a in parent.anchors if a[0] <= prog.chars]
                prog.pieces = [x for x in parent.pieces if x[1] <= prog.chars]
        return prog

    def _apply(self, event: ProgramEvent) -> None:
        if event.get("type") == "program_begin" and event.get("continues"):
            self._continuation(cast(ProgramBeginEvent, event))
            return
        handler = _HANDLERS.get(event.get("type", ""))
        if handler is not None:
            handler(self, self._program(event), event)

    def _program_begin(self, p: _Program, e: ProgramBeginEvent) -> None:
        p.name, p.arguments = e.get("name", ""), dict(e.get("arguments") or {})

    def _continuation(self, e: ProgramBeginEvent) -> None:
        """A finished state goes on (a new run from its text). A view that showed its earlier run shows it
        growing in place; another view (a later cell's) starts with the earlier text, collapsed."""
        old = self._alias.get(str(e["continues"]), str(e["continues"]))
        prog = self._programs.get(old)
        if prog is not None:
            self._alias[str(e.get("program"))] = old
            prog.status, prog.error, prog.t_end = "running", None, None
            return
        prog = self._program(e)
        self._program_begin(prog, e)
        text = str(e.get("text") or "")
        prog.advance(text)
        if text:
            shown = text if len(text) <= MAX_PRIOR_CHARS else "..." + text[-MAX_PRIOR_CHARS:]
            prog.segments.append({"k": "prior", "text": shown, "chars": len(text), "from": old})

    def _text(self, p: _Program, e: TextEvent) -> None:
        text, var = e.get("text", ""), e.get("var")
        start = p.advance(text)
        gen = p.open_gen
        if gen is not None:  # a gen's chunk (one per token run when streaming, one in all otherwise)
            if not gen["text"]:
                p.first_chunk_t = self._now
            gen["text"] += text
            gen["chunks"] += 1
            if not gen["done"] and isinstance(e.get("progress"), dict):  # its counts so far: the header moves
                gen["meta"].update(e["progress"])
            if p.thinking is not None:
                self._think(p, gen, *p.thinking.feed(text), fed=len(text))
            return
        if var is not None:  # a select's choice arrives as text first, then the select event
            p.segments.append({"k": "select", "var": var, "text": text, "choices": []})
            return
        seg = {"k": "text", "text": text, "tmpl": has_marker(text)}  # a role marker: shown muted
        p.segments.append(seg)
        p.unread.append((seg, start))

    def _gen_begin(self, p: _Program, e: GenBeginEvent) -> None:
        constraint = e.get("constraint")
        seg: dict[str, Any] = {"k": "gen", "var": e.get("var"), "rid": e.get("rid"), "where": e.get("where"), "text": "",
               "constraint": str(constraint)[:300] if constraint else None,
               "constraint_name": e.get("constraint_name"), "done": False, "chunks": 0,
               "meta": {}, "tokens": None, "logprobs": False, "ttft": None, "elapsed": None}
        p.thinking, p.thinking_fed, p.thinking_closed_t = None, 0, None
        if e.get("reasoning"):  # separate_reasoning wraps it: its thinking is split off as it streams
            p.thinking = ReasoningStream(str(e["reasoning"]))
            seg["think"] = {"format": p.thinking.fmt.name, "state": "start", "text": "", "tokens": 0,
                            "seconds": None, "end": None, "done": False}
        p.segments.append(seg)
        p.open_gen, p.open_gen_t, p.first_chunk_t = seg, self._now, None
        if isinstance(seg["rid"], str):
            p.gen_start[seg["rid"]] = p.chars

    def _think(self, p: _Program, gen: dict[str, Any], reasoning: str, answer: str, *, fed: int) -> None:
        """Fold what the open gen's ReasoningStream gave for its last `fed` characters into its `think`."""
        stream, think = p.thinking, gen["think"]
        assert stream is not None
        p.thinking_fed += fed
        think["text"] += reasoning
        if think["end"] is None and think["state"] != "answer":
            think["tokens"] = int(gen["meta"].get("completion_tokens") or think["tokens"])
        think["state"] = stream.state
        if think["end"] is None and stream.state == "answer":  # the answer starts: where, and after how long
            think["end"] = max(0, p.thinking_fed - len(stream.buffer) - len(answer))
            think["seconds"] = round(self._now - p.open_gen_t, 3) if think["end"] else None
            p.thinking_closed_t = self._now

    def _gen_end(self, p: _Program, e: GenEndEvent) -> None:
        seg = p.open_gen
        if seg is None or seg["rid"] != e.get("rid"):
            seg = next((s for s in reversed(p.segments) if s["k"] == "gen" and s["rid"] == e.get("rid")), None)
            if seg is None:
                return
        assert seg is not None
        meta: MetaInfo = {**(e.get("meta_info") or {})}
        seg["meta"] = meta_subset(meta, _META_KEYS)
        seg["tokens"] = token_detail(seg["text"], meta)
        seg["logprobs"] = bool(seg["tokens"]) and any(t[2] is not None for t in seg["tokens"])
        seg["done"] = True
        # one clock for both: the engine's TTFT with its latency; else the wall time to the first streamed
        # chunk (a gen that was not streamed has no first token to time: its text arrives with its end)
        first = p.first_chunk_t
        streamed = first is not None and seg["chunks"] > 1
        ttft = meta.get("ttft", first - p.open_gen_t if first is not None and streamed else None)
        seg["ttft"] = round(ttft, 4) if isinstance(ttft, (int, float)) else None
        seg["elapsed"] = round(self._now - p.open_gen_t, 4)
        ended: dict[str, Any] = seg
        if p.open_gen is ended and p.thinking is not None:
            self._think_done(p, seg, meta)
        if p.open_gen is ended:
            p.open_gen = None
        if isinstance(e.get("prompt_chars"), int):
            self._mark_cached(p, seg, e["prompt_chars"], meta.get("cached_chars"))

    def _think_done(self, p: _Program, seg: dict[str, Any], meta: MetaInfo) -> None:
        """The gen ended: the rest of its split, the reasoning's exact token count (its tokens up to where the
        answer starts) and, for a gen not streamed, its time on the engine's clock (the decode time shared by
        the tokens)."""
        stream, think = p.thinking, seg["think"]
        assert stream is not None
        cut_off = stream.state == "reasoning" or (stream.state == "start" and stream.fmt.starts_inside)
        self._think(p, seg, *stream.finish(), fed=0)
        p.thinking = None
        if think["end"] is None:  # cut off while thinking (all of it is reasoning), or it never opened
            think["end"] = len(seg["text"]) if cut_off else 0
        think["state"], think["done"] = "answer", True
        if not think["end"]:
            think["tokens"], think["seconds"] = 0, None
            return
        if seg["tokens"]:
            pos, n = 0, 0
            for part, *_ in seg["tokens"]:
                if pos >= think["end"]:
                    break
                pos, n = pos + len(part), n + 1
            think["tokens"] = n
        elif not think["tokens"]:
            think["tokens"] = estimate_tokens(seg["text"][: think["end"]])
        # on the engine's clock where it has one (as TTFT and latency): streamed, its TTFT plus the stream's time
        # from the first piece to the closing marker; else the decode time shared by the tokens
        out, ttft, e2e = meta.get("completion_tokens"), meta.get("ttft"), meta.get("e2e_latency")
        if cut_off:
            think["seconds"] = e2e if isinstance(e2e, (int, float)) else seg["elapsed"]
        elif p.thinking_closed_t is not None and p.first_chunk_t is not None and isinstance(ttft, (int, float)):
            think["seconds"] = round(ttft + p.thinking_closed_t - p.first_chunk_t, 3)
        elif seg["chunks"] <= 1 and isinstance(out, int) and out > 0 and isinstance(ttft, (int, float)) \
                and isinstance(e2e, (int, float)):
            think["seconds"] = round(ttft + (e2e - ttft) * min(1.0, think["tokens"] / out), 3)

    def _reasoning(self, p: _Program, e: ReasoningEvent) -> None:
        """separate_reasoning split a gen: its text is the split's (one implementation), and the program's text
        lost the thinking (the cached-prompt estimates count from the shorter text)."""
        var = e.get("var")
        seg = next((s for s in reversed(p.segments) if s["k"] == "gen" and s["var"] == var), None)
        if seg is None or "think" not in seg:
            return
        seg["think"]["text"] = str(e.get("reasoning") or "")
        removed = len(seg["text"]) - len(str(e.get("answer") or ""))
        start = p.gen_start.get(str(seg["rid"]))
        if removed > 0 and start is not None:
            p.chars = max(start, p.chars - removed)
            p.pieces = [x for x in p.pieces if x[1] <= start]
            p.anchors = [a for a in p.anchors if a[0] <= start]
            if p.chars > start:
                p.pieces.append((start, p.chars, str(e.get("answer") or "")))

    def _mark_cached(self, p: _Program, seg: dict[str, Any], prompt_chars: int, reported: Any = None) -> None:
        """Mark the prompt text this gen read first (the text segments since the last gen, and its ancestors'
        before the fork when it is a branch's first gen) with how much of it the cache served: where the
        backend says the hit ends (`reported`: the engine's cached_chars), else an estimate from the token
        counts; and learn this gen's (characters, tokens) points for the next gens' estimates."""
        m = seg["meta"]
        prompt, cached, done = m.get("prompt_tokens"), m.get("cached_tokens"), m.get("completion_tokens")
        if not isinstance(prompt, int) or not isinstance(cached, int):
            return
        p.chars = prompt_chars + len(seg["text"])  # the interpreter's count is exact: realign on it
        if isinstance(reported, int) and 0 <= reported <= prompt_chars:
            # the engine computes a prompt's last token again even when the cache holds it (for its logits), so a
            # hit of all but that token is what finding the whole prompt reads as
            whole = 0 < cached and cached >= prompt - 1
            cut, exact = prompt_chars if whole else reported, True
        else:
            cut, exact = cached_chars(p.pieces, p.anchors, prompt_chars, prompt, cached)
        readers: list[tuple[dict[str, Any], int]] = []
        prog: _Program | None = p
        limit = prompt_chars
        while prog is not None:
            readers += [(s, start) for s, start in prog.unread if start < limit]
            prog.unread = [(s, start) for s, start in prog.unread if start >= limit]
            parent = self._programs.get(prog.parent) if prog.parent else None
            limit = parent.fork_at.get(prog.id, limit) if parent is not None else limit
            prog = parent
        if not exact:  # cache hits end at a boundary the program wrote (a role, a fork): snap to a near one
            edges = [b for s, start in readers for b in (start, start + len(s["text"]))]
            near = min(edges, key=lambda b: abs(b - cut), default=cut)
            if abs(near - cut) <= max(3, 2 * prompt_chars / max(prompt, 1)):  # within about two tokens
                cut = near
        for s, start in readers:
            s["cached"] = max(0, min(cut - start, len(s["text"])))
        seg["cached_chars"], seg["cached_exact"] = cut, exact
        p.anchors += [(prompt_chars, prompt)]
        if isinstance(done, int) and seg["tokens"] is not None and len(seg["tokens"]) == done:
            p.anchors += [(p.chars, prompt + done)]

    def _select(self, p: _Program, e: SelectEvent) -> None:
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
        seg["meta"] = meta_subset(e.get("meta_info") or {}, _META_KEYS)
        seg["elapsed"] = round(e["elapsed"], 4) if isinstance(e.get("elapsed"), (int, float)) else None
        seg["choices"] = [{"text": c, "logprob": logprobs[i] if i < len(logprobs) else None,
                           "p": probs[i] if i < len(probs) else None, "chosen": c == choice}
                          for i, c in enumerate(choices)]

    def _role_begin(self, p: _Program, e: RoleEvent) -> None:
        p.segments.append({"k": "role_begin", "role": e.get("role")})

    def _role_end(self, p: _Program, e: RoleEvent) -> None:
        p.segments.append({"k": "role_end", "role": e.get("role")})

    def _media(self, p: _Program, e: MediaEvent) -> None:
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
        p.advance(str(e.get("text") or ""), 1)  # its tokens are the engine's to know: the points absorb them

    def _fork(self, p: _Program, e: ForkEvent) -> None:
        children = [str(c) for c in e.get("children") or []]
        p.segments.append({"k": "fork", "children": children})
        for c in children:
            p.fork_at[c] = p.chars
            if c not in p.children:
                p.children.append(c)

    def _var(self, p: _Program, e: VarEvent) -> None:
        name = e.get("name")
        if name is not None and name not in p.variables:
            p.variables.append(name)

    def _error(self, p: _Program, e: ErrorEvent) -> None:
        if p.status == "interrupted":
            return  # what the interrupt made fail next (the aborted request) is not another error
        p.error = {"message": str(e.get("message", ""))[:2000], "where": e.get("where")}
        # where a traceback follows the view (a %%sgl cell), the view marks the spot and names the error's
        # kind; the message itself is the traceback's to say (said twice, it was read twice)
        p.segments.append({"k": "error", **p.error, "below": self.errors_below and not e.get("interrupted")})
        p.status = "interrupted" if e.get("interrupted") else "error"
        p.t_end = self._now
        if p.open_gen is not None and not e.get("interrupted"):
            if p.thinking is not None:
                self._think_done(p, p.open_gen, {})
            p.open_gen["done"] = True
            p.open_gen = None
        # an interrupted gen stays open for what it wrote until the abort reached it (its text and gen_end
        # come after this event); the program's end closes it otherwise

    def _end(self, p: _Program, e: EndEvent) -> None:
        if p.status == "running":
            p.status = "done"
        p.t_end = p.t_end or self._now
        if p.open_gen is not None:
            if p.thinking is not None:
                self._think_done(p, p.open_gen, {})
            p.open_gen["done"] = True
            p.open_gen = None

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
        """The widget view, a short text/plain (what a terminal prints) and a static text/html snapshot (what a
        renderer without the widget shows: GitHub, nbviewer, an exported page; see `_static.py`)."""
        from sgnb.widgets._static import with_snapshot

        return with_snapshot(self, super()._repr_mimebundle_(**kwargs))


# each kind's handler takes that kind's record (sgnb.program_events)
_HANDLERS: dict[str, Callable[[ProgramView, _Program, Any], None]] = {
    "program_begin": ProgramView._program_begin,
    "text": ProgramView._text,
    "gen_begin": ProgramView._gen_begin,
    "gen_end": ProgramView._gen_end,
    "select": ProgramView._select,
    "reasoning": ProgramView._reasoning,
    "role_begin": ProgramView._role_begin,
    "role_end": ProgramView._role_end,
    "image": ProgramView._media,
    "video": ProgramView._media,
    "fork": ProgramView._fork,
    "var": ProgramView._var,
    "error": ProgramView._error,
    "end": ProgramView._end,
}
