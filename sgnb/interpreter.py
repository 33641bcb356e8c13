"""The interpreter: one StreamExecutor per program state, its nodes run in order on a shared, bounded thread pool.

`s += node` submits without blocking; the executor appends text and calls the backend in order. Reading a
variable blocks until it is set. An exception stops the state: later nodes are skipped, waiting readers wake
up, and the error is raised at `s["v"]` / `sync()` with the program line that submitted the failing node.
Executors publish trace events (text, gen chunks, selects, roles, images, forks) to subscribers, such as widgets:
sgnb.program_events defines each kind.
Threads: an executor with nodes to run holds one of the pool's threads until its queue is empty; at most
PROGRAM_THREADS run nodes at once (`fork(1000)` starts no 1,000 threads: the branches take turns), plus one for
each pool thread that waits inside a node on other states (a join, a variable of a fork), so that waiting never
starves the states it waits for.

The class is split by concept, in the style of the engine's Scheduler: this module holds its core (construction,
submission and the pool, the dispatch table, variables and events, failure and abort, forks, copies and
continuations, what callers and views read); its node handlers are mixins beside it: `interpreter_gen` (gen,
streaming, tool calls, select), `interpreter_roles` (roles and their messages, images and videos, var scopes,
separate_reasoning).
"""

from __future__ import annotations

import contextlib
import difflib
import itertools
import logging
import queue
import threading
import types
import weakref
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

from sgnb import ir
from sgnb.backends.base import Backend
from sgnb.chat_template import ChatTemplate
from sgnb.engine.events import wait_slice
from sgnb.engine.meta_info import MetaInfo, meta_subset
from sgnb.interpreter_gen import DTYPE_REGEX as DTYPE_REGEX  # noqa: F401 (its name here before the split)
from sgnb.interpreter_gen import GenHandlers
from sgnb.interpreter_roles import RoleHandlers
from sgnb.media import Media
from sgnb.program_events import (
    EndEvent,
    ErrorEvent,
    ForkEvent,
    ProgramBeginEvent,
    ProgramEvent,
    Subscriber,
    TextEvent,
    VarEvent,
)
from sgnb.sampling import DEFAULT_PARAMS, GenParams
from sgnb.user_code import (
    _chain,
    frame_at,
    frame_kind,
    render_traceback,
    user_traceback,
)

log = logging.getLogger("sgnb")
_ids = itertools.count()
# program threads running nodes at once. A gen holds its thread while it waits on the backend, so this is also
# how many of a program's gens can be in flight together: as many as the engine runs in one batch by default
# (EngineConfig.max_running_requests). At 64, tree_of_thought's 512 leaves at GPU scale decoded in 8 rounds
# instead of 2, and the run timed out.
PROGRAM_THREADS = 256


class _ProgramPool:
    """The threads that run executors' nodes. `schedule(exe)` queues an executor whose queue has nodes; a free
    thread drains it (runs its nodes in order until its queue is empty). At most `size` threads are running
    nodes; a thread that blocks inside a node on other executors (`blocking()`) does not count, so the
    executors it waits for still get threads. Idle threads exit after a while."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._cond = threading.Condition()
        self._ready: deque[StreamExecutor] = deque()
        self._threads = self._idle = self._blocked = 0
        self._local = threading.local()

    def schedule(self, exe: StreamExecutor) -> None:
        with self._cond:
            self._ready.append(exe)
            # every idle thread, notified or not yet awake, takes one ready executor: when they are fewer than
            # the ready ones, start a thread (a thread notified earlier still counts as idle until it wakes, so
            # "some thread is idle" would leave executors queued behind a running one)
            if self._idle > 0:
                self._cond.notify()
            if self._idle < len(self._ready) and self._threads - self._blocked < self.size:
                self._spawn()

    @property
    def threads(self) -> int:
        return self._threads

    def _spawn(self) -> None:  # holding _cond
        self._threads += 1
        threading.Thread(target=self._run, name=f"sgnb-program-{self._threads}", daemon=True).start()

    def _run(self) -> None:
        self._local.worker = True
        while True:
            with self._cond:
                while not self._ready:
                    self._idle += 1
                    woke = self._cond.wait(timeout=30.0)
                    self._idle -= 1
                    if not woke and not self._ready:
                        self._threads -= 1
                        return
                exe = self._ready.popleft()
            try:
                exe._drain()
            except BaseException:  # _drain records node failures itself; never lose the thread's count
                log.exception("program executor failed")

    @contextlib.contextmanager
    def blocking(self) -> Iterator[None]:
        """Around a wait on other executors: from a pool thread it frees a running slot meanwhile."""
        if not getattr(self._local, "worker", False):
            yield
            return
        with self._cond:
            self._blocked += 1
            if len(self._ready) > self._idle and self._threads - self._blocked < self.size:
                self._spawn()
        try:
            yield
        finally:
            with self._cond:
                self._blocked -= 1


_POOL = _ProgramPool(PROGRAM_THREADS)


class ProgramError(RuntimeError):
    """A program failed; the message names the program line that submitted the failing primitive.

    `where` is that line ("file:line: statement") when known. Shown by IPython (a notebook), the traceback is
    the user's part only: their frames down to the line that read the error, then the program line that failed
    (sgnb's own frames and the chained original error are left out; `__cause__` still holds the original)."""

    def __init__(self, message: str = "", where: str | None = None, detail: str | None = None) -> None:
        super().__init__(message)
        self.where = where
        self.detail = detail  # the message without the line, for a traceback that shows the line
        self.below: types.FrameType | None = None  # frames down to this one are not the user's (a magic's)
        self.origin: types.TracebackType | None = None  # the cause's traceback as it was caught (else its own)

    def _render_traceback_(self) -> list[str]:
        tb = user_traceback(self.__traceback__, self.below)
        cause = self.__cause__
        origin = user_traceback(self.origin or cause.__traceback__) if cause is not None else None
        if origin is None and self.where:
            origin = frame_at(self.where)
        shown = self if origin is None or not self.detail else ProgramError(self.detail)
        return render_traceback(shown, _chain(tb, origin))


class Failure(NamedTuple):
    """How a program failed: the error as it was caught, the program line ("file:line: statement") it happened
    at when known, and whether an interrupt (`abort`) stopped the program rather than an error of its own."""

    error: BaseException
    where: str | None
    interrupted: bool


def show_user_traceback(exc: BaseException, below: types.FrameType | None = None,
                        tb: types.TracebackType | None = None) -> BaseException:
    """Make IPython show `exc` with only the user's frames (`user_traceback`, computed when it is shown, over
    `tb` or the traceback the exception then has). Chained exceptions are shown only when the user's own code
    raised it. Returns `exc`. A ProgramError renders itself (with the program line that failed); it only
    learns `below`."""
    if isinstance(exc, ProgramError):
        exc.below = below
        return exc

    def render() -> list[str]:
        full = tb if tb is not None else exc.__traceback__
        last = full
        while last is not None and last.tb_next is not None:
            last = last.tb_next
        own = last is not None and frame_kind(last.tb_frame) == "user"
        return render_traceback(exc, user_traceback(full, below), chain=own)

    try:
        exc._render_traceback_ = render  # type: ignore[attr-defined]
    except (AttributeError, TypeError):  # an exception type without instance attributes
        pass
    return exc


def _names_set_by(node: ir.Node) -> list[str]:
    """The variables running `node` sets (what `s[name]` may wait for once it is appended)."""
    if isinstance(node, ir.Sequence):
        return [n for item in node.items for n in _names_set_by(item)]
    if isinstance(node, (ir.Gen, ir.Select)) and node.name is not None:
        return [node.name]
    if isinstance(node, ir.VarScopeEnd):
        return [node.name]
    if isinstance(node, ir.SeparateReasoning):
        return [f"{n}_reasoning_content" for n in node.names]
    return []


class StreamExecutor(GenHandlers, RoleHandlers):
    def __init__(self, backend: Backend, defaults: GenParams = DEFAULT_PARAMS, *, stream: bool = False,
                 stream_interval_s: float | None = None, use_thread: bool = True, num_api_spec_tokens: int | None = None,
                 chat_template: ChatTemplate | None = None, parent: StreamExecutor | None = None, name: str = "",
                 subscribers: Iterable[Subscriber] = ()) -> None:
        self.id = f"p{next(_ids)}"
        self.name = name  # the program's name (views show it)
        self.backend = backend
        self.defaults = defaults
        self.stream = stream
        self.stream_interval_s = stream_interval_s  # GenContext's: how often a streamed gen's pieces come
        self.num_api_spec_tokens = num_api_spec_tokens
        self.chat_template = chat_template or backend.get_chat_template()
        self.text_ = ""
        self.messages_: list[dict[str, Any]] = []
        self.images_: list[Media] = []  # images and videos, in the order the program added them
        self.variables: dict[str, Any] = {}
        self.meta_info: dict[str, MetaInfo] = {}  # a gen's or select's, by its variable
        self.var_events: defaultdict[str, threading.Event] = defaultdict(threading.Event)
        # names that appended, not yet run nodes will set: reading any other unset name fails at once
        self.pending_vars: Counter[str] = Counter()
        self._pending_lock = threading.Lock()
        self.cur_role: str | None = None
        self.cur_role_begin = 0
        # the open role's spans of text that are not message content (tool descriptions, calls), its calls, and
        # the call a tool message answers; the calls of the last assistant message no tool message answered yet
        self.role_hidden: list[tuple[int, int]] = []
        self.role_calls: list[dict[str, Any]] = []
        self.role_answers: str | None = None
        self.unanswered: list[str] = []
        self.var_scopes: dict[str, int] = {}
        # variables whose gens a separate_reasoning being run wraps -> its format's name (gen_begin tells views)
        self.reasoning_vars: dict[str, str] = {}
        self.fork_start = 0
        self.fork_media = 0  # images_ inherited from the parent at the fork
        self.where_: str | None = None  # the innermost node being run that knows its program line
        # the failure (set by `fail` only): the error, the program line, its traceback as it was caught
        self.error_: BaseException | None = None
        self.error_where: str | None = None
        self.error_tb: types.TracebackType | None = None
        self.program_scratch: dict[str, Any] = {}
        self.current_rid: str | None = None
        self.subscribers: list[Subscriber] = [*(parent.subscribers if parent else ()), *subscribers]
        self.parent_id = parent.id if parent else None
        # streamed chunks (var name or None, text) for text_iter; readers wait on the condition
        self.chunks: list[tuple[str | None, str, MetaInfo | None]] = []  # (variable, text, the gen's meta so far)
        self.chunks_cond = threading.Condition()
        self.done = False
        self.ended = False  # end() was called: no more nodes (a later append continues the state instead)
        self.aborted = False
        self.children: weakref.WeakSet[StreamExecutor] = weakref.WeakSet()  # forks and copies of this state
        self.use_thread = use_thread
        self.queue: queue.Queue = queue.Queue()
        self._scheduled = False  # on the pool's ready queue or being drained by a pool thread
        self._sched_lock = threading.Lock()
        self.closed = threading.Event()  # the end of the queue (end()'s None) was reached: nothing more runs

    @property
    def variable_event(self) -> defaultdict[str, threading.Event]:
        """SGLang's name for `var_events` (one Event per variable, set once it has its value)."""
        return self.var_events

    # ---- submission -----------------------------------------------------------------------------------
    def submit(self, node: ir.Node) -> None:
        names = _names_set_by(node)
        if names:
            with self._pending_lock:
                self.pending_vars.update(names)
        if self.use_thread:
            self.queue.put(node)
            self._kick()
        else:
            self._run_node(node)

    def drained(self, timeout: float | None = None) -> bool:
        q = self.queue
        with q.all_tasks_done:
            return q.all_tasks_done.wait_for(lambda: q.unfinished_tasks == 0,
                                             wait_slice() if timeout is None else timeout)

    def sync(self) -> None:
        """Wait until every submitted node ran (interruptible; an interrupt aborts the running request)."""
        if self.use_thread:
            self.wait(self.drained, "sync")

    def end(self) -> None:
        """No more nodes: finish the stream (text_iter readers stop) once the queue drains. The state's forks
        and copies that were not joined end with it (their own appends still run first)."""
        if self.ended:
            return
        self.ended = True
        for child in list(self.children):
            child.end()
        if self.use_thread:
            self.queue.put(None)
            self._kick()
        else:
            self._close_stream()

    def descendants(self) -> list[StreamExecutor]:
        """This state's forks and copies, theirs, and so on."""
        out: list[StreamExecutor] = []
        for child in list(self.children):
            out += [child, *child.descendants()]
        return out

    def continuation(self, backend: Backend | None = None, defaults: GenParams | None = None,
                     stream: bool | None = None, subscribers: list[Subscriber] | None = None,
                     name: str | None = None, arguments: dict[str, str] | None = None) -> StreamExecutor:
        """A new executor that goes on from this finished one: its text, messages, images, variables and open
        role (a new run whose requests hit the cache for this text). Waits for this one to finish; raises
        ProgramError, saying what to do instead, when it cannot continue (it failed or was interrupted)."""
        if not self.ended:
            self.end()
        self.wait(self.drained, "sync")
        if self.use_thread:
            self.wait(lambda: self.closed.wait(wait_slice()), "sync")
        if self.error_ is not None:
            what = "was interrupted" if self.aborted else f"failed ({_describe(self.error_, self.error_where)})"
            raise ProgramError(f"this program state {what}, so it cannot continue: re-run the cell or program "
                               "that made it, then continue that state")
        nxt = self._derived(backend, defaults, stream)
        nxt.name, nxt.parent_id = self.name if name is None else name, self.parent_id
        # the same run going on: what its gens and scopes recorded, and where a fork's own text began
        nxt.meta_info = dict(self.meta_info)
        nxt.var_scopes, nxt.program_scratch = dict(self.var_scopes), self.program_scratch
        nxt.fork_start, nxt.fork_media = self.fork_start, self.fork_media
        if self.text_:  # text_iter() of the continued state reads its whole text
            nxt.chunks.append((None, self.text_, None))
        nxt.subscribers.extend(subscribers or [])
        nxt.emit(ProgramBeginEvent(program=nxt.id, parent=nxt.parent_id, type="program_begin", name=nxt.name,
                                   arguments=dict(arguments or {}), continues=self.id, text=self.text_))
        return nxt

    def _kick(self) -> None:
        """Have a pool thread drain the queue unless one is on it (or the stream ended)."""
        with self._sched_lock:
            if self._scheduled or self.closed.is_set():
                return
            self._scheduled = True
        _POOL.schedule(self)

    def _drain(self) -> None:
        """Run the queued nodes in order (on a pool thread) until the queue is empty or the stream ends."""
        while True:
            try:
                node = self.queue.get_nowait()
            except queue.Empty:
                with self._sched_lock:
                    if self.queue.empty():  # a submit after this sees _scheduled False and schedules again
                        self._scheduled = False
                        return
                continue
            try:
                if node is None:
                    self._close_stream()
                    self.closed.set()
                    return  # stays "scheduled": nothing appended after the end runs (a continuation does)
                self._run_node(node)
            finally:
                self.queue.task_done()

    def _run_node(self, node: ir.Node) -> None:
        try:
            self._run_node_inner(node)
        finally:
            names = _names_set_by(node)
            if names:
                with self._pending_lock:
                    self.pending_vars.subtract(names)
                    self.pending_vars = +self.pending_vars  # drop the zero counts

    def _run_node_inner(self, node: ir.Node) -> None:
        if self.error_ is not None:
            return  # a failed program runs nothing more
        self.where_ = None
        try:
            self._execute(node)
        except BaseException as e:  # includes backend errors; surfaces at s["v"] / sync()
            log.debug("program %s failed at %s", self.id, self.where_ or node.where, exc_info=True)
            self.fail(e, self.where_ or node.where)

    # ---- node handlers (dispatch table at the end of the module; gen, select and tools are in interpreter_gen,
    # roles, media, var scopes and reasoning in interpreter_roles) ---------------------------------------------
    def _execute(self, node: ir.Node) -> None:
        handler = _HANDLERS.get(type(node))
        if handler is None:
            raise TypeError(f"cannot append a {type(node).__name__} to a program")
        outer = self.where_
        if node.where is not None:
            self.where_ = node.where
        handler(self, node)
        self.where_ = outer  # on an exception it stays at the failing node's line

    def _text(self, node: ir.Text) -> None:
        self._append(node.text)

    def _sequence(self, node: ir.Sequence) -> None:
        split = node.items[-1] if node.items and isinstance(node.items[-1], ir.SeparateReasoning) else None
        if split is None:
            for item in node.items:
                self._execute(item)
            return
        # separate_reasoning(expr): the gens inside expr announce the format, so views split them as they stream
        outer = dict(self.reasoning_vars)
        name = self._reasoning_format(split).name
        self.reasoning_vars.update((n, name) for n in split.names)
        try:
            for item in node.items:
                self._execute(item)
        finally:
            self.reasoning_vars = outer

    def _append(self, text: str, var: str | None = None, meta: MetaInfo | None = None) -> None:
        if not text:
            return
        self.text_ += text
        with self.chunks_cond:
            self.chunks.append((var, text, meta))
            self.chunks_cond.notify_all()
        # a literal, not TextEvent(...): one comes per streamed piece, and the call costs three literals
        event: TextEvent = {"program": self.id, "parent": self.parent_id, "type": "text", "text": text, "var": var}
        if meta:  # a gen's piece: its token counts so far (views keep their counters moving while it streams)
            event["progress"] = meta_subset(meta, _PROGRESS_KEYS)
        self.emit(event)

    def _derived(self, backend: Backend | None = None, defaults: GenParams | None = None,
                 stream: bool | None = None, parent: StreamExecutor | None = None) -> StreamExecutor:
        """A new executor that starts from this state (a fork's branch, a copy, a continuation): its settings
        (the backend, defaults and stream unless given), its name, text, messages, images and variables, inside the
        same open role (with its calls). `parent`: the state it branches from (its views see the branch)."""
        new = StreamExecutor(backend or self.backend, self.defaults if defaults is None else defaults,
                             stream=self.stream if stream is None else stream,
                             stream_interval_s=self.stream_interval_s, use_thread=self.use_thread,
                             num_api_spec_tokens=self.num_api_spec_tokens, chat_template=self.chat_template,
                             parent=parent)
        new.name = self.name
        new.text_, new.messages_, new.images_ = self.text_, list(self.messages_), list(self.images_)
        new.variables = dict(self.variables)
        for k in new.variables:
            new.var_events[k].set()
        new.cur_role, new.cur_role_begin = self.cur_role, self.cur_role_begin
        new.role_hidden, new.role_calls = list(self.role_hidden), list(self.role_calls)
        new.role_answers, new.unanswered = self.role_answers, list(self.unanswered)
        return new

    def _concate_and_append(self, node: ir.ConcateAndAppend) -> None:
        for state in node.states:
            exe = state.executor
            exe.sync()
            if exe.error_ is not None:
                raise ProgramError(f"a fork failed: {exe.error_}") from exe.error_
            self.images_.extend(exe.images_[exe.fork_media:])  # what the branch added after the fork
            self._append(exe.text_[exe.fork_start:])

    # ---- variables and events --------------------------------------------------------------------------
    def _set_var(self, name: str, value: Any) -> None:
        self.variables[name] = value
        self.var_events[name].set()
        self.emit(VarEvent(program=self.id, parent=self.parent_id, type="var", name=name))

    def set_var(self, name: str, value: Any) -> None:
        self.sync()
        self._set_var(name, value)

    def get_var(self, name: str, timeout: float | None = None) -> Any:
        ev = self.var_events[name]
        if not ev.is_set():
            with self._pending_lock:
                coming = self.pending_vars[name] > 0
            if not coming and name not in self.variables and self.error_ is None:
                # nothing appended so far sets it: waiting would wait forever (SGLang raises at once too)
                raise KeyError(f"no variable {name!r} in this program: nothing appended to it sets that name"
                               + self._known_names(name))
            self.wait(lambda: ev.wait(wait_slice()), name)
        if name in self.variables:
            return self.variables[name]
        self.raise_error()
        raise KeyError(f"no variable {name!r} in this program" + self._known_names(name))

    def _known_names(self, name: str) -> str:
        """The rest of a missing variable's message: the names that are set or being generated, and the close
        one the user may have meant."""
        with self._pending_lock:
            coming = sorted(n for n in self.pending_vars if n not in self.variables)
        known = sorted(self.variables)
        parts = [f"set: {known}" if known else "none is set yet"]
        if coming:
            parts.append(f"being generated: {coming}")
        close = difflib.get_close_matches(name, known + coming, n=1, cutoff=0.0 if len(known + coming) == 1 else 0.6)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        return f" ({', '.join(parts)}){hint}"

    def wait(self, poll: Callable[[], bool], what: str) -> None:
        """Wait in short slices so KeyboardInterrupt lands; on interrupt, abort the in-flight request."""
        try:
            with _POOL.blocking():
                while not poll():
                    if self.error_ is not None and what != "sync":
                        return
                    if self.use_thread and self.closed.is_set() and not poll():
                        raise ProgramError(f"the program ended without setting {what!r}")
        except KeyboardInterrupt as e:
            self.abort()
            # shown (by IPython) as the user's line that waited, not sgnb's and threading's frames under it
            raise show_user_traceback(KeyboardInterrupt("interrupted: the program and its request were "
                                                        "aborted")).with_traceback(e.__traceback__) from None

    def fail(self, error: BaseException, where: str | None, interrupted: bool = False) -> bool:
        """Record the program's failure (the first one only: what an abort makes fail next is not news): what
        the state's readers raise (`raise_error`), and views are told. The error's traceback is kept as it is
        now, from where it was caught to where it was raised (re-raising it later, as a cell does, would add
        the frames it passes through). False when the program had failed already."""
        if self.error_ is not None:
            return False
        self.error_, self.error_where, self.error_tb = error, where, error.__traceback__
        self.aborted = self.aborted or interrupted
        self.emit(ErrorEvent(program=self.id, parent=self.parent_id, type="error", where=where, interrupted=interrupted,
                             message="interrupted" if interrupted else f"{type(error).__name__}: {error}"))
        for ev in list(self.var_events.values()):
            ev.set()
        return True

    def abort(self) -> None:
        """Stop the program: nothing more runs, and the in-flight request (if any) is aborted."""
        self.fail(ProgramError("the program was interrupted (aborted, with its request)"), self.where_,
                  interrupted=True)
        for ev in list(self.var_events.values()):
            ev.set()
        if self.current_rid is not None:
            self.backend.abort(self.current_rid)

    def abort_all(self) -> None:
        """Abort this state, then its forks and copies (`descendants()`): an interrupt stops the whole run."""
        for exe in (self, *self.descendants()):
            exe.abort()

    def raise_error(self) -> None:
        if self.error_ is not None:
            error = ProgramError(_describe(self.error_, self.error_where), self.error_where,
                                 _describe(self.error_, None))
            error.origin = self.error_tb
            raise error from self.error_

    # ---- what callers and views read of a run (the fields behind it are assigned in this class only) -----
    @property
    def failure(self) -> Failure | None:
        """The program's failure, the first one `fail` recorded; None while it has not failed."""
        error = self.error_
        return None if error is None else Failure(error, self.error_where, self.aborted)

    @property
    def current_line(self) -> str | None:
        """The program line the state is at: its failure's, else that of the innermost node being run (None
        between nodes, or when no node knows its line)."""
        return self.error_where or self.where_

    def emit(self, event: ProgramEvent) -> None:
        """Give `event` (a sgnb.program_events record, its `program` and `parent` this state's) to the subscribers."""
        if not self.subscribers:
            return
        for callback in list(self.subscribers):
            try:
                callback(event)
            except Exception:
                log.exception("program event subscriber failed")

    def _close_stream(self) -> None:
        with self.chunks_cond:
            self.done = True
            self.chunks_cond.notify_all()
        self.emit(EndEvent(program=self.id, parent=self.parent_id, type="end"))
        self.subscribers = []  # the run is over: what comes after (a continuation, a copy) is not its view's

    # ---- fork --------------------------------------------------------------------------------------------
    def fork(self, n: int) -> list[StreamExecutor]:
        self.sync()
        self.raise_error()
        if n > 1 and self.text_:
            # frontend hint: the branches share this prefix, images included (passed only when there are some:
            # backends and wrappers written before images take one argument)
            if self.images_:
                self.backend.cache_prefix(self.text_, list(self.images_))
            else:
                self.backend.cache_prefix(self.text_)
        children = []
        for _ in range(n):
            child = self._derived(parent=self)
            self.children.add(child)
            child.fork_start, child.fork_media = len(self.text_), len(self.images_)
            children.append(child)
        self.emit(ForkEvent(program=self.id, parent=self.parent_id, type="fork", children=[c.id for c in children]))
        return children


def _describe(error: BaseException, where: str | None) -> str:
    """A program's failure in one line: the error (its type named unless it is a ProgramError) and the line."""
    text = str(error) if isinstance(error, ProgramError) else f"{type(error).__name__}: {error}"
    return f"{text} (at {where})" if where and where not in text else text


_PROGRESS_KEYS = ("prompt_tokens", "cached_tokens", "completion_tokens")


_HANDLERS: dict[type, Callable[[StreamExecutor, Any], None]] = {
    ir.Text: StreamExecutor._text,
    ir.Sequence: StreamExecutor._sequence,
    ir.Gen: StreamExecutor._gen,
    ir.Select: StreamExecutor._select,
    ir.RoleBegin: StreamExecutor._role_begin,
    ir.RoleEnd: StreamExecutor._role_end,
    ir.Tools: StreamExecutor._tools,
    ir.Image: StreamExecutor._image,
    ir.Video: StreamExecutor._video,
    ir.VarScopeBegin: StreamExecutor._var_scope_begin,
    ir.VarScopeEnd: StreamExecutor._var_scope_end,
    ir.ConcateAndAppend: StreamExecutor._concate_and_append,
    ir.SeparateReasoning: StreamExecutor._separate_reasoning,
}
