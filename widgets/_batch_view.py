"""The table of a `run_batch`: one row per program (its arguments, variables, status, progress), fed by the
programs' events.

`run_batch` shows one in a notebook (an IPython kernel with a frontend) when the caller passed no subscribers
of its own, through a `BatchTable`: a batch still running after `BatchTable.delay` (1 s) gets a live BatchView
then, which updates until the batch ends; a batch that ends sooner gets a BatchSnapshot when it ends, its final
table as static HTML. Both draw from one `BatchRows`. Like ProgramView's, the view's callbacks only append to a
buffer; a Ticker thread folds it into the rows and syncs them at <= 4 Hz, one message per flush; the rows live in
synced traits (their layout is documented in `batch_view.js`), and the output carries the static picture too, so
a saved notebook shows the finished batch either way.
"""

from __future__ import annotations

import re
import threading
import time
from typing import Any, cast

import anywidget
import traitlets

from sgnb.program_events import ErrorEvent, GenBeginEvent, GenEndEvent, ProgramEvent, Subscriber, TextEvent
from sgnb.widgets._display import refresh, show
from sgnb.widgets._esm import bundle
from sgnb.widgets._ticker import BATCH_INTERVAL, Ticker

MAX_ROWS = 200  # rows synced (the first ones of the batch); the counts cover every program
MAX_VALUE = 80  # characters of a value shown in a cell
MAX_COLUMNS = 12  # argument and variable columns


def _short(text: str, limit: int = MAX_VALUE) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 1] + "…"


_ADDRESS = re.compile(r" at 0x[0-9A-Fa-f]+")


def argument_text(value: Any, limit: int = 60) -> str:
    """A program argument as a table cell: what it is for images, arrays and bytes (not their repr with a memory
    address), the repr otherwise."""
    module = type(value).__module__
    if module.startswith("PIL.") and hasattr(value, "size") and hasattr(value, "mode"):
        return f"[image {value.size[0]}x{value.size[1]} {value.mode}]"
    if module == "numpy" and hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"[array {tuple(value.shape)} {value.dtype}]"
    if isinstance(value, (bytes, bytearray, memoryview)):
        return f"[{len(bytes(value))} bytes]"
    return _short(_ADDRESS.sub("", repr(value)), limit)


class _Row:
    def __init__(self, index: int, arguments: dict[str, str]) -> None:
        self.index, self.arguments = index, arguments
        self.program: str | None = None
        self.status = "queued"
        self.values: dict[str, str] = {}  # variable -> its text so far (a gen's chunks, a select's choice)
        self.gens = 0  # gens begun, branches' included
        self.gens_done = 0
        self.tokens = 0  # generated tokens of finished gens
        self.error = ""
        self.t_begin: float | None = None
        self.t_end: float | None = None

    def to_json(self, now: float) -> dict[str, Any]:
        elapsed = None if self.t_begin is None else round((self.t_end or now) - self.t_begin, 2)
        return {"i": self.index, "program": self.program, "arguments": dict(self.arguments),
                "status": self.status, "values": {k: _short(v) for k, v in self.values.items()}, "gens": self.gens,
                "gens_done": self.gens_done, "tokens": self.tokens, "error": self.error, "elapsed": elapsed}


class BatchRows:
    """The rows of a batch's table and the events that feed them: `add` (any thread) only buffers; `fold` applies
    what is buffered, `finish(states)` takes run_batch's final states, `state()` is what the views show."""

    def __init__(self, arguments: list[dict[str, Any]], t_begin: float | None = None) -> None:
        self._lock = threading.Lock()  # guards _pending
        self._pending: list[tuple[int, float, ProgramEvent]] = []  # (program, arrival time, event)
        self.rows = [_Row(i, {k: argument_text(v) for k, v in a.items()}) for i, a in enumerate(arguments)]
        self.t_begin = time.time() if t_begin is None else t_begin  # (the batch's start: its elapsed time)
        self.t_end: float | None = None

    def add(self, events: list[tuple[int, float, ProgramEvent]]) -> None:
        """Buffer events: (program index, arrival time, event)."""
        with self._lock:
            self._pending.extend(events)

    def fold(self) -> bool:
        """Apply the buffered events to the rows; False when there were none."""
        with self._lock:
            events, self._pending = self._pending, []
        for index, when, event in events:
            if 0 <= index < len(self.rows):
                self._apply(self.rows[index], event, when)
        return bool(events)

    def finish(self, states: list[Any]) -> None:
        """The batch is over: each row takes its state's variables and final status (a None state: cancelled)."""
        self.fold()
        for row, state in zip(self.rows, states):
            if state is None:
                if row.status in ("queued", "running"):
                    row.status = "cancelled"
                continue
            exe = state.executor
            row.values.update({k: v if isinstance(v, str) else repr(v) for k, v in exe.variables.items()})
            failure = exe.failure
            if failure is not None:
                row.status = "interrupted" if failure.interrupted else "error"
                row.error = row.error or _short(f"{type(failure.error).__name__}: {failure.error}", 300)
            elif row.status in ("queued", "running"):
                row.status = "done"
        for row in self.rows:
            if row.status in ("queued", "running"):
                row.status = "cancelled"
        self.t_end = time.time()

    def _apply(self, row: _Row, e: ProgramEvent, now: float) -> None:
        kind, pid = e.get("type"), str(e.get("program") or "")
        if row.program is None and e.get("parent") is None:
            row.program = pid
        if row.t_begin is None:
            row.t_begin, row.status = now, "running"
        own = pid == row.program  # a branch's gens count toward progress; its values come with finish()
        if kind == "gen_begin":
            begin = cast(GenBeginEvent, e)
            row.gens += 1
            if own and begin.get("var"):
                row.values[str(begin["var"])] = ""
        elif kind == "gen_end":
            row.gens_done += 1
            row.tokens += int((cast(GenEndEvent, e).get("meta_info") or {}).get("completion_tokens") or 0)
        elif kind == "text" and own and e.get("var"):
            text = cast(TextEvent, e)
            row.values[str(text["var"])] = row.values.get(str(text["var"]), "") + str(text.get("text", ""))
        elif kind == "error" and row.status not in ("error", "interrupted"):
            error = cast(ErrorEvent, e)
            row.status = "interrupted" if error.get("interrupted") else "error"
            row.error = _short(str(error.get("message", "")), 300)
            row.t_end = now
        elif kind == "end" and own:
            if row.status == "running":
                row.status = "done"
            row.t_end = row.t_end or now

    def state(self) -> dict[str, Any]:
        """The views' values of now: columns, rows (the first MAX_ROWS), summary."""
        now = time.time()
        names: list[str] = []
        for row in self.rows:  # argument columns first, then variables, in the order they appear
            names += [k for k in row.arguments if k not in names]
        variables: list[str] = []
        for row in self.rows:
            variables += [k for k in row.values if k not in variables and k not in names]
        counts = {s: sum(r.status == s for r in self.rows)
                  for s in ("queued", "running", "done", "error", "interrupted", "cancelled")}
        summary = {"total": len(self.rows), **counts, "gens": sum(r.gens_done for r in self.rows),
                   "tokens": sum(r.tokens for r in self.rows), "shown": min(len(self.rows), MAX_ROWS),
                   "arguments": len(names), "elapsed": round((self.t_end or now) - self.t_begin, 2)}
        return {"columns": (names + variables)[:MAX_COLUMNS],
                "rows": [r.to_json(now) for r in self.rows[:MAX_ROWS]], "summary": summary}


def _batch_repr(kind: str, title: str, summary: dict[str, Any]) -> str:
    s = summary
    return (f"<{kind} {title!r}: {s.get('done', 0)}/{s.get('total', 0)} done, "
            f"{s.get('running', 0)} running, {s.get('error', 0)} failed>")


class BatchView(anywidget.AnyWidget):
    """A live table of a batch's programs, one row each: arguments, variables, status, gens done and tokens.

    `BatchView("name", [arguments per program])` starts with every row queued; feed program i's events to
    `subscriber_for(i)` (any thread), and call `finish(states)` with run_batch's states at the end (the final
    values and statuses, cancelled programs included; on the cell's thread, since a view displayed with
    `sgnb.widgets._display.show` then sends its output again, with the final snapshot)."""

    _esm = bundle("batch_view.js")

    title = traitlets.Unicode("").tag(sync=True)
    columns = traitlets.List(traitlets.Unicode()).tag(sync=True)
    rows = traitlets.List(traitlets.Dict()).tag(sync=True)
    summary = traitlets.Dict().tag(sync=True)

    def __init__(self, title: str = "", arguments: list[dict[str, Any]] | None = None, *,
                 interval: float = BATCH_INTERVAL, t_begin: float | None = None,
                 early: list[tuple[int, float, ProgramEvent]] | None = None, **kwargs: Any) -> None:
        self._flush_lock = threading.RLock()
        self._batch = BatchRows(arguments or [], t_begin)
        self.interval = max(interval, 0.05)  # seconds between syncs; run_batch streams its gens at this pace too
        self._ticker = Ticker(self.flush, self.interval, "sgnb-batch-view", idle_stop=2.0)
        self._batch.add(early or [])  # events from before the view (see BatchTable)
        super().__init__(title=title, **self._batch.state(), **kwargs)  # the rows travel with the widget's opening

    # ---- feeding -----------------------------------------------------------------------------------------
    def subscriber_for(self, index: int) -> Subscriber:
        """The event callback for the batch's program `index` (its branches' events come through it too)."""

        def on_event(event: ProgramEvent) -> None:
            self._batch.add([(index, time.time(), event)])  # timed on arrival, not at the later flush
            self._ticker.start()

        return on_event

    def take(self, events: list[tuple[int, float, ProgramEvent]]) -> None:
        """Events that came while the view was being made: (program index, arrival time, event)."""
        if events:
            self._batch.add(events)
            self._ticker.start()

    def finish(self, states: list[Any]) -> None:
        """The batch is over: each row takes its state's variables and final status (a None state: cancelled)."""
        with self._flush_lock:
            self._batch.finish(states)
            self._send_rows()
        refresh(self)  # the output's static snapshot: the finished batch (when `show` displayed the view)

    def close(self) -> None:
        self._ticker.stop()
        super().close()

    # ---- syncing -----------------------------------------------------------------------------------------
    def flush(self) -> bool:
        """Fold the buffered events into the rows and sync them (one message). False when nothing was pending."""
        with self._flush_lock:
            if not self._batch.fold():
                return False
            self._send_rows()
            return True

    def _send_rows(self) -> None:
        with self.hold_sync():
            for name, value in self._batch.state().items():
                setattr(self, name, value)

    # ---- text forms --------------------------------------------------------------------------------------
    def __repr__(self) -> str:
        return _batch_repr("BatchView", self.title, self.summary)

    def _repr_mimebundle_(self, **kwargs: Any) -> tuple[dict, dict] | None:
        """The widget view, a short text/plain and a static text/html snapshot of the table (what a renderer
        without the widget shows: GitHub, nbviewer, an exported page; see `_static.py`)."""
        from sgnb.widgets._static import with_snapshot

        return with_snapshot(self, super()._repr_mimebundle_(**kwargs))


class BatchSnapshot:
    """The table of a batch that ended before its live table was due: its final picture as HTML (the same
    drawing a BatchView's output carries for renderers without widgets), with no widget behind it, since
    nothing in it will change. Same title / columns / rows / summary attributes as a BatchView."""

    def __init__(self, title: str, batch: BatchRows) -> None:
        self.title = title
        state = batch.state()
        self.columns: list[str] = state["columns"]
        self.rows: list[dict[str, Any]] = state["rows"]
        self.summary: dict[str, Any] = state["summary"]

    def __repr__(self) -> str:
        return _batch_repr("BatchSnapshot", self.title, self.summary)

    def _repr_mimebundle_(self, **kwargs: Any) -> tuple[dict, dict]:
        from sgnb.widgets._static import batch_html

        return {"text/plain": repr(self),
                "text/html": batch_html(self.title, self.columns, self.rows, self.summary)}, {}


class BatchTable:
    """What `run_batch` feeds in a notebook: the programs' events, kept (with their arrival times) until a
    BatchView exists to take them. `show()` makes and displays the live view; run_batch calls it once the batch
    has run `delay` seconds, so a long batch gets a live table early. A batch that ends sooner gets a
    BatchSnapshot when it ends: its final table as static HTML, displayed once, with no widget (on the GPU host
    the cell's thread spends ~2.8 ms on it after a 64-program batch, where a live table's opening, layout model,
    display and final sync took ~7.5 ms: benchmarks/bench_views.py, results of 2026-12-06). Call `show` and
    `finish` on the cell's thread."""

    # seconds a batch runs before its live table shows. A live table costs the cell's thread ~7.5 ms (made and
    # displayed, then its final sync and snapshot: GPU host, 64 rows), so the delay bounds its share of any batch
    # that gets one to 7.5 ms / delay: ~3% at 0.25 s, under 1% at 1 s (benchmarks/bench_views.py).
    delay = 1.0

    def __init__(self, title: str, arguments: list[dict[str, Any]]) -> None:
        self.title, self.arguments = title, arguments
        self.interval = BATCH_INTERVAL  # the table's refresh, and the pace its programs' gens stream at
        self.view: BatchView | None = None
        self._lock = threading.Lock()  # guards _early and the moment `view` is set
        self._early: list[tuple[int, float, ProgramEvent]] = []
        self._t_begin = time.time()

    def subscriber_for(self, index: int) -> Subscriber:
        """The event callback for the batch's program `index` (any thread)."""
        feed: Subscriber | None = None

        def on_event(event: ProgramEvent) -> None:
            nonlocal feed
            if feed is None:
                with self._lock:
                    if self.view is None:
                        self._early.append((index, time.time(), event))
                        return
                feed = self.view.subscriber_for(index)
            feed(event)

        return on_event

    def show(self) -> BatchView:
        """Make and display the live table (once), with the events so far."""
        if self.view is None:
            with self._lock:
                early, self._early = self._early, []
            view = BatchView(self.title, self.arguments, interval=self.interval, t_begin=self._t_begin, early=early)
            with self._lock:  # from here on the programs feed the view
                view.take(self._early)
                self._early = []
                self.view = view
            show(view)  # under a display id: finish() sends the output again, with the final snapshot
        return self.view

    def finish(self, states: list[Any]) -> BatchView | BatchSnapshot:
        """The batch is over: the live table takes the final states (see BatchView.finish); a table not shown yet
        is displayed once, as a BatchSnapshot."""
        if self.view is not None:
            self.view.finish(states)
            return self.view
        with self._lock:
            early, self._early = self._early, []
        batch = BatchRows(self.arguments, self._t_begin)
        batch.add(early)
        batch.finish(states)
        snapshot = BatchSnapshot(self.title, batch)
        show(snapshot)
        return snapshot
