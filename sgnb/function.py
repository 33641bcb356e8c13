"""`@function`: an LM program. `run` executes it on a backend; `run_batch` runs many with a prefix hint."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import os
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any

from sgnb import ir
from sgnb.backends.base import Backend
from sgnb.interpreter import StreamExecutor
from sgnb.program_events import ProgramBeginEvent, Subscriber
from sgnb.sampling import DEFAULT_PARAMS, GenParams
from sgnb.state import ProgramState
from sgnb.user_code import location, user_traceback

_default_backend: Backend | None = None
_default_lock = threading.Lock()


def set_default_backend(backend: Backend | None) -> None:
    global _default_backend
    with _default_lock:
        _default_backend = backend


def get_default_backend() -> Backend | None:
    return _default_backend


class GlobalConfig:
    """`sgl.global_config`, SGLang's process-wide frontend settings, honoured where they mean something here:

    - `default_backend`: the backend set_default_backend sets (reading and assigning it are the same as
      get_default_backend / set_default_backend);
    - `verbosity`: 2 or more prints each run_batch program's text when it ends (SGLang's level for that);
    - `skip_special_tokens_in_output`: False keeps special tokens in generated text (in-process and remote);
    - `enable_precache_with_tracing`: False stops run_batch from caching the programs' traced prefix first;
    - `spaces_between_special_tokens_in_out`, `enable_parallel_encoding`: accepted, with a warning that they
      change nothing here (the detokenizer puts no spaces between special tokens; a join's branches share
      their KV through the radix cache either way).
    Any other name is set as on a plain object, with a warning (SGLang's GlobalConfig has no such setting)."""

    verbosity: int
    skip_special_tokens_in_output: bool
    spaces_between_special_tokens_in_out: bool
    enable_precache_with_tracing: bool
    enable_parallel_encoding: bool

    _MEANINGLESS = {"spaces_between_special_tokens_in_out": "the detokenizer puts no spaces between special tokens",
                    "enable_parallel_encoding": "a join's branches share their KV through the radix cache either way"}

    def __init__(self) -> None:
        object.__setattr__(self, "verbosity", 0)
        object.__setattr__(self, "skip_special_tokens_in_output", True)
        object.__setattr__(self, "spaces_between_special_tokens_in_out", True)
        object.__setattr__(self, "enable_precache_with_tracing", True)
        object.__setattr__(self, "enable_parallel_encoding", True)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "default_backend":
            set_default_backend(value)
            return
        if name in self._MEANINGLESS:
            warnings.warn(f"sgnb: global_config.{name} changes nothing here: {self._MEANINGLESS[name]}",
                          stacklevel=2)
        elif not hasattr(self, name):
            warnings.warn(f"sgnb: global_config.{name} is no setting of SGLang's or sgnb's; it is stored but "
                          "nothing reads it", stacklevel=2)
        object.__setattr__(self, name, value)

    @property
    def default_backend(self) -> Backend | None:
        return get_default_backend()


global_config = GlobalConfig()


def _resolve_backend(backend: Backend | None) -> Backend:
    backend = backend or _default_backend
    if backend is None:
        raise RuntimeError("no backend: pass backend=... or call sgnb.set_default_backend(sgnb.Runtime(...))")
    return backend


class SglFunction:
    def __init__(self, func: Callable[..., Any], num_api_spec_tokens: int | None = None,
                 bind_arguments: dict[str, Any] | None = None) -> None:
        self.func = func
        self.num_api_spec_tokens = num_api_spec_tokens
        self.bind_arguments = dict(bind_arguments or {})
        params = list(inspect.signature(func).parameters.values())
        if not params:
            raise TypeError(f"an sgnb function takes the program state as its first argument: {func.__name__}(s, ...)")
        self.arg_names = [p.name for p in params[1:]]
        self.__name__ = getattr(func, "__name__", "program")
        self.__doc__ = func.__doc__

    def bind(self, **kwargs: Any) -> SglFunction:
        unknown = set(kwargs) - set(self.arg_names)
        if unknown:
            raise TypeError(f"{self.__name__}() has no argument(s) {sorted(unknown)}")
        return SglFunction(self.func, self.num_api_spec_tokens, {**self.bind_arguments, **kwargs})

    def _bind_args(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        sig = inspect.signature(self.func)
        bound = sig.bind_partial(None, *args, **{**self.bind_arguments, **kwargs})
        bound.apply_defaults()
        values = dict(bound.arguments)
        values.pop(next(iter(sig.parameters)))
        missing = [n for n in self.arg_names if n not in values]
        if missing:
            raise TypeError(f"{self.__name__}() missing argument(s) {missing}")
        return values

    @staticmethod
    def _defaults(keywords: dict[str, Any]) -> GenParams:
        """The program defaults from run()'s (run_batch()'s) arguments: their GenParams fields, by name (their
        keyword defaults are DEFAULT_PARAMS' values; tests/lang/test_sampling_names.py checks that)."""
        return GenParams.from_keywords(keywords).merged(DEFAULT_PARAMS)

    def run(self, *args: Any, max_new_tokens: int = 128, n: int = 1, stop: Any = None, stop_token_ids: Any = None,
            stop_regex: Any = None, temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1,
            min_p: float = 0.0, frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
            ignore_eos: bool = False, return_logprob: bool | None = None, logprob_start_len: int | None = None,
            top_logprobs_num: int | None = None, return_text_in_logprobs: bool | None = None,
            stream: bool = False, backend: Backend | None = None, use_thread: bool = True,
            subscribers: list[Subscriber] | None = None, stream_interval_s: float | None = None,
            **kwargs: Any) -> ProgramState:
        """Run the program; returns its state at once (gens run in the background; reading waits). With
        `stream`, a gen's text comes in pieces at most every `stream_interval_s` seconds (default: the
        backend's pace)."""
        defaults = self._defaults(locals())
        arguments = self._bind_args(args, kwargs)
        return self._run(_resolve_backend(backend), arguments, defaults, stream, use_thread, subscribers or [],
                         stream_interval_s)

    def run_on(self, state: ProgramState, *args: Any, backend: Backend | None = None, stream: bool | None = None,
               subscribers: list[Subscriber] | None = None, sampling: dict[str, Any] | None = None,
               **kwargs: Any) -> ProgramState:
        """Run this program's body on an existing state, which goes on from where it is: a finished state (what
        `run()` returned, a `%%sgl -o NAME` cell's) continues from its text, messages and variables, and its
        requests hit the cache for that text (a state still running ends its run first: inside a program,
        call `fn(s, ...)` instead). Returns `state` itself. `backend` (default: the state's),
        `stream` and `sampling` (run()'s sampling defaults by their names, e.g. `{"temperature": 0}`, over the
        state's) apply from here on; `subscribers` (views) see this run. Raises ProgramError at once when the
        state cannot continue (its program failed or was interrupted)."""
        arguments = self._bind_args(args, kwargs)
        old = state.executor
        defaults = GenParams.build(**sampling).merged(old.defaults) if sampling else None
        exe = old.continuation(backend, defaults, stream, subscribers, name=self.__name__,
                               arguments={k: repr(v)[:200] for k, v in arguments.items()})
        state.executor = exe
        return self._run_body(state, arguments)

    def _run(self, backend: Backend, arguments: dict[str, Any], defaults: GenParams, stream: bool,
             use_thread: bool, subscribers: list[Subscriber],
             stream_interval_s: float | None = None) -> ProgramState:
        exe = StreamExecutor(backend, defaults, stream=stream, stream_interval_s=stream_interval_s,
                             use_thread=use_thread,
                             num_api_spec_tokens=self.num_api_spec_tokens, name=self.__name__,
                             subscribers=subscribers)
        exe.emit(ProgramBeginEvent(program=exe.id, parent=exe.parent_id, type="program_begin", name=self.__name__,
                                   arguments={k: repr(v)[:200] for k, v in arguments.items()}))
        return self._run_body(ProgramState(exe), arguments)

    def _run_body(self, state: ProgramState, arguments: dict[str, Any]) -> ProgramState:
        try:
            state.ret_value = self.func(state, **arguments)
        except BaseException as e:  # a Python error in the body: the state records it, like a primitive's
            exe = state.executor
            # views learn of it as of a primitive's failure (a cell that raised must not read "done")
            exe.fail(e, _body_location(e), interrupted=isinstance(e, KeyboardInterrupt))
            if not isinstance(e, Exception):  # KeyboardInterrupt: the whole run stops, forks and copies too
                exe.abort_all()
                exe.end()
                e.program_state = state  # type: ignore[attr-defined]  # (the caller may keep the state)
                raise
        state.executor.end()  # the body may have continued the state (a new executor) if it ended early
        return state

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """`f(s, ...)` inside another program runs f's body on that state; `f(...)` alone is `f.run(...)`."""
        if args and isinstance(args[0], ProgramState):
            return self.func(args[0], *args[1:], **{**self.bind_arguments, **kwargs})
        return self.run(*args, **kwargs)

    async def run_async(self, *args: Any, **kwargs: Any) -> ProgramState:
        """Awaitable run: the program executes on its own thread; awaits its completion."""
        state = self.run(*args, **kwargs)
        await asyncio.to_thread(state.executor.sync)
        return state

    def run_batch(self, batch_kwargs: list[dict[str, Any]] | list[list[Any]], *, max_new_tokens: int = 128,
                  n: int = 1, stop: Any = None,
                  stop_token_ids: Any = None, stop_regex: Any = None, temperature: float = 1.0, top_p: float = 1.0,
                  top_k: int = -1, min_p: float = 0.0, frequency_penalty: float = 0.0,
                  presence_penalty: float = 0.0, ignore_eos: bool = False, return_logprob: bool | None = None,
                  logprob_start_len: int | None = None, top_logprobs_num: int | None = None,
                  return_text_in_logprobs: bool | None = None, backend: Backend | None = None,
                  num_threads: int | str = "auto", progress_bar: bool = False, frontend_hints: bool = True,
                  subscribers: list[Subscriber] | None = None,
                  stream: bool | None = None, generator_style: bool = False,
                  stream_interval_s: float | None = None) -> Any:
        """Run the program once per kwargs dict, concurrently. A failing program does not stop the others
        (its state's error() tells). With frontend_hints, the program's constant prefix is traced and cached
        first, so the batch shares it from the start. In a notebook, with no subscribers given, a live table
        of the programs (arguments, variables, status, progress) is displayed (instead of the progress bar).
        `stream`: gens stream to the subscribers and the table (default: when the table is shown), their text in
        pieces at most every `stream_interval_s` seconds (default: the table's refresh, 0.25 s, with the table;
        the backend's pace, 0.05 s in-process, without: 64 programs' threads waking 20 times a second cost a
        GPU-speed batch ~5% of its throughput, benchmarks/bench_views.py). As in SGLang, each item is a dict of
        arguments or a list of them by position; with `generator_style=True` the states come one by one, in
        batch order, as each finishes (a generator)."""
        if not isinstance(batch_kwargs, (list, tuple)):
            raise TypeError("run_batch takes a list of argument dicts (or of positional argument lists)")
        backend = _resolve_backend(backend)
        defaults = self._defaults(locals())
        all_args = [self._bind_args(tuple(kw), {}) if isinstance(kw, (list, tuple)) else self._bind_args((), kw)
                    for kw in batch_kwargs]
        if generator_style:
            return self._batch_generator(all_args, backend, defaults, num_threads, progress_bar, frontend_hints,
                                         subscribers, bool(stream), stream_interval_s)
        if frontend_hints and global_config.enable_precache_with_tracing and len(all_args) > 1:
            self.cache(backend)
        num_threads = _thread_count(num_threads, len(all_args))
        table = None if subscribers else _batch_table(self.__name__, all_args)
        streamed = table is not None if stream is None else bool(stream)
        if stream_interval_s is None and table is not None:
            stream_interval_s = table.interval
        bar = None
        if progress_bar and table is None:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(all_args), desc=self.__name__)

        cancelled = threading.Event()
        live: dict[int, ProgramState] = {}  # by batch index, the programs that started

        def one(item: tuple[int, dict[str, Any]]) -> ProgramState | None:
            index, arguments = item
            if cancelled.is_set():
                return None
            feed = [table.subscriber_for(index)] if table is not None else []
            state = self._run(backend, arguments, defaults, streamed, True, [*(subscribers or []), *feed],
                              stream_interval_s)
            live[index] = state
            if cancelled.is_set():
                state.abort()
            state.error()  # wait for it to finish (errors stay in the state)
            if global_config.verbosity >= 2:  # SGLang's level for printing each batch program's text
                print(state.executor.text_)
            if bar is not None:
                bar.update(1)
            return state

        pool = ThreadPoolExecutor(int(num_threads))
        try:
            futures = [pool.submit(one, item) for item in enumerate(all_args)]
            if table is not None and wait_futures(futures, timeout=table.delay).not_done:
                table.show()  # a batch still running: its live table (a shorter one's comes when it ends)
            states = [f.result() for f in futures]
        except BaseException:  # KeyboardInterrupt: abort every program and its in-flight request
            cancelled.set()
            for state in list(live.values()):
                state.abort()
            pool.shutdown(wait=True, cancel_futures=True)
            raise
        finally:
            if bar is not None:
                bar.close()
            if table is not None:  # the final values and statuses (an interrupted batch's rows too)
                table.finish([live.get(i) for i in range(len(all_args))])
        pool.shutdown()
        return states

    def _batch_generator(self, all_args: list[dict[str, Any]], backend: Backend, defaults: GenParams,
                         num_threads: int | str, progress_bar: bool, frontend_hints: bool,
                         subscribers: list[Subscriber] | None, stream: bool,
                         stream_interval_s: float | None) -> Iterator[ProgramState]:
        """run_batch(generator_style=True): the programs run as run_batch runs them; each state is yielded, in
        batch order, once it has finished. Closing the generator early (or an interrupt) aborts the rest."""
        if frontend_hints and global_config.enable_precache_with_tracing and len(all_args) > 1:
            self.cache(backend)
        threads = _thread_count(num_threads, len(all_args))
        bar = None
        if progress_bar:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(all_args), desc=self.__name__)

        cancelled = threading.Event()
        live: list[ProgramState] = []

        def one(arguments: dict[str, Any]) -> ProgramState | None:
            if cancelled.is_set():
                return None
            state = self._run(backend, arguments, defaults, stream, True, list(subscribers or []), stream_interval_s)
            live.append(state)
            if cancelled.is_set():
                state.abort()
            state.error()  # wait for it to finish (errors stay in the state)
            if global_config.verbosity >= 2:  # SGLang's level for printing each batch program's text
                print(state.executor.text_)
            return state

        pool = ThreadPoolExecutor(threads)
        futures = [pool.submit(one, a) for a in all_args]
        try:
            for future in futures:
                state = future.result()
                if bar is not None:
                    bar.update(1)
                yield state  # type: ignore[misc]
        finally:  # closed early or interrupted: what has not finished is aborted
            cancelled.set()
            for state in list(live):
                if not state.executor.done:
                    state.abort()
            pool.shutdown(wait=False, cancel_futures=True)
            if bar is not None:
                bar.close()

    def cache(self, backend: Backend | None = None) -> str:
        """Cache the program's constant prefix (the text every run starts with, found by tracing) in the
        backend ahead of the runs, as SGLang's `cache()` does. Returns that prefix ("" when there is none)."""
        backend = _resolve_backend(backend)
        prefix = self.constant_prefix(backend)
        if prefix:
            backend.cache_prefix(prefix)
        return prefix

    # ---- tracing -----------------------------------------------------------------------------------------
    def trace(self, backend: Backend | None = None, **kwargs: Any) -> TracedProgram:
        """Run the body without a model: arguments and variables are placeholders. Returns the IR nodes."""
        from sgnb.tracer import trace_program

        return trace_program(self, backend or _default_backend, kwargs)

    def constant_prefix(self, backend: Backend) -> str:
        """The text every run of this program starts with (up to the first argument or generated value)."""
        try:
            return self.trace(backend).constant_prefix
        except Exception:  # a body that cannot be traced simply gets no hint
            return ""


@dataclasses.dataclass
class TracedProgram:
    """What `fn.trace()` records: the program's nodes in order, flattened as SGLang's TracerProgramState lists
    them (one node per text, role boundary, gen, select, image ...; no sequences), and the constant prefix.
    Unlike SGLang's, role boundaries stay RoleBegin / RoleEnd nodes (the chat template renders them when the
    program runs, on whichever backend) and an argument is a placeholder inside its text node, not a node of
    its own; so the counts differ where a program has roles or arguments."""

    name: str
    nodes: list[ir.Node]
    constant_prefix: str


def _thread_count(num_threads: int | str, programs: int) -> int:
    """run_batch's threads: "auto" is one per program up to 4 per core and 64 in all."""
    if num_threads == "auto":
        return max(1, min(programs, 4 * (os.cpu_count() or 1), 64))
    return int(num_threads)


def _batch_table(name: str, all_args: list[dict[str, Any]]) -> Any:
    """In a notebook (an IPython kernel with a frontend), the table of the batch's programs that run_batch feeds
    (sgnb.widgets' BatchTable: displayed once the batch has run a moment, or when it ends); elsewhere, or
    without the widgets' packages, None. IPython is only looked at when something imported it already: a script
    never pays for it."""
    if "IPython" not in sys.modules:
        return None
    from IPython import get_ipython

    shell = get_ipython()
    if shell is None or getattr(shell, "kernel", None) is None:
        return None
    try:
        from sgnb.widgets._batch_view import BatchTable
    except ImportError:
        return None
    return BatchTable(name, all_args)


def _body_location(e: BaseException) -> str | None:
    """The program line an error in the body came from: the innermost of the user's frames (an error raised
    inside gen() is the gen() line's, not sgnb's)."""
    tb = user_traceback(e.__traceback__)
    if tb is None:
        tb = e.__traceback__
        if tb is None:
            return None
    while tb.tb_next is not None:
        tb = tb.tb_next
    return location(tb.tb_frame.f_code.co_filename, tb.tb_lineno)


def function(func: Callable[..., Any] | None = None, *, num_api_spec_tokens: int | None = None) -> Any:
    """Decorator: `@function` or `@function(num_api_spec_tokens=64)`."""
    if func is None:
        return lambda f: SglFunction(f, num_api_spec_tokens=num_api_spec_tokens)
    return SglFunction(func, num_api_spec_tokens=num_api_spec_tokens)
