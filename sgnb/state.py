"""ProgramState: what a program function receives as `s` and what `run()` returns."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

from sgnb import ir
from sgnb.engine.meta_info import MetaInfo
from sgnb.interpreter import ProgramError, StreamExecutor
from sgnb.primitives import as_node, role, tool
from sgnb.user_code import user_location


class ProgramState:
    """The state of one running program. `s += x` appends; `s["v"]` blocks until variable v is set.

    A finished state (what `run()` returns once its body is done, a `%%sgl -o NAME` cell's state) continues:
    appending to it starts a new run from its text, messages and variables (on the same backend, whose cache
    holds that text), so a chat goes on across cells: `chat += user("..."); chat += assistant(gen("a2"))`.
    A state whose program failed or was interrupted cannot continue: the append raises, saying so."""

    def __init__(self, executor: StreamExecutor) -> None:
        self.executor = executor
        self.ret_value: Any = None

    def _live(self) -> StreamExecutor:
        """The executor appends go to: this state's, or, once its run has ended, a continuation of it."""
        if self.executor.ended:
            self.executor = self.executor.continuation()
        return self.executor

    # ---- building ---------------------------------------------------------------------------------------
    def __iadd__(self, other: Any) -> ProgramState:
        node = as_node(other)
        self._live().submit(node)
        return self

    def _role(self, name: str, content: Any = None, tools: list[dict[str, Any]] | None = None,
              tool_call_id: str | None = None) -> Any:
        if content is None and tools is None:
            return self._role_scope(name, tool_call_id)
        self += role(name, content, tools, tool_call_id)
        return None

    @contextlib.contextmanager
    def _role_scope(self, name: str, tool_call_id: str | None = None) -> Iterator[None]:
        self._live().submit(ir.RoleBegin(name, tool_call_id, where=user_location()))
        yield
        self._live().submit(ir.RoleEnd(name, where=user_location()))

    def system(self, content: Any = None, tools: list[dict[str, Any]] | None = None) -> Any:
        """`s.system("...")` appends a system message; `with s.system(): ...` wraps appends in one.
        `tools=[...]`: the message describes them too (see sgnb.system)."""
        return self._role("system", content, tools=tools)

    def user(self, content: Any = None) -> Any:
        return self._role("user", content)

    def assistant(self, content: Any = None) -> Any:
        return self._role("assistant", content)

    def tool(self, content: Any = None, tool_call_id: str | None = None) -> Any:
        """`s.tool(result)` appends a tool's result (see sgnb.tool); `with s.tool(): ...` wraps appends in one."""
        if content is None:
            return self._role_scope("tool", tool_call_id)
        self += tool(content, tool_call_id)
        return None

    @contextlib.contextmanager
    def var_scope(self, name: str) -> Iterator[None]:
        """Everything appended inside becomes variable `name` too."""
        self._live().submit(ir.VarScopeBegin(name, where=user_location()))
        yield
        self._live().submit(ir.VarScopeEnd(name, where=user_location()))

    def fork(self, size: int = 1, position_ids_offset: Any = None) -> ProgramStateGroup:
        """Branch into `size` states sharing this prefix (cached once in the engine). Waits for pending work."""
        if size < 1:
            raise ValueError("fork size must be >= 1")
        children = self.executor.fork(size)
        return ProgramStateGroup([ProgramState(c) for c in children], self)

    def copy(self, position_ids_offset: Any = None) -> CopiedState:
        """A branch of this state (a fork of one). Used as SGLang documents it, `with s.copy() as c: c += ...`,
        it is joined back when the block ends: the variables it set become one-item lists in this state."""
        copied = CopiedState(self.executor.fork(1)[0])
        copied.group = ProgramStateGroup([copied], self)
        return copied

    @property
    def stream_executor(self) -> StreamExecutor:
        """SGLang's name for the state's executor (`s.stream_executor.variables`, `.variable_event`, ...)."""
        return self.executor

    # ---- reading ----------------------------------------------------------------------------------------
    def __getitem__(self, name: str) -> Any:
        return self.executor.get_var(name)

    def get_var(self, name: str) -> Any:
        return self.executor.get_var(name)

    def __setitem__(self, name: str, value: Any) -> None:
        self.executor.set_var(name, value)

    def set_var(self, name: str, value: Any) -> None:
        self.executor.set_var(name, value)

    def __contains__(self, name: str) -> bool:
        self._settle()
        return name in self.executor.variables

    def get_meta_info(self, name: str) -> MetaInfo:
        self.get_var(name)
        return self.executor.meta_info.get(name, {})

    def tool_calls(self, name: str) -> list[dict[str, Any]]:
        """The tool calls gen(name, tools=...) made, in OpenAI's shape ({"id", "type": "function", "function":
        {"name", "arguments": a JSON string}}); [] when it answered in text (or max_tokens cut the call)."""
        return list(self.get_meta_info(name).get("tool_calls") or [])

    def sync(self) -> ProgramState:
        """Wait until every appended primitive ran; raise the program's error if it failed."""
        self.executor.sync()
        self.executor.raise_error()
        return self

    def _settle(self) -> None:
        """Wait for the program; raise its error, unless it was interrupted: an interrupted program's text,
        messages and variables are what it wrote until then (an interrupted gen's partial text included)."""
        self.executor.sync()
        failure = self.executor.failure
        if failure is None or not failure.interrupted:
            self.executor.raise_error()

    def text(self) -> str:
        self._settle()
        return self.executor.text_

    def messages(self) -> list[dict[str, Any]]:
        self._settle()
        return list(self.executor.messages_)

    def error(self) -> BaseException | None:
        """The program's failure (wrapped with the line it happened at), or None. Waits for pending work."""
        try:
            self.sync()
        except ProgramError as e:
            return e
        return None

    def variables(self) -> dict[str, Any]:
        self._settle()
        return dict(self.executor.variables)

    def abort(self) -> None:
        self.executor.abort()

    # ---- streaming --------------------------------------------------------------------------------------
    def text_iter(self, var_name: str | None = None, return_meta_data: bool = False) -> Iterator[Any]:
        """Text as it is appended (run with stream=True for token-by-token gens); only var_name's if given.
        return_meta_data=True (SGLang's): (text, meta_info) pairs, meta_info being the gen's as it stood when
        that text arrived (completion_tokens so far; the full meta_info with its last piece; None for text
        that no gen produced); with logprobs asked for, each pair's "output_token_logprobs" holds its new
        tokens' only and "output_token_logprobs_length" the count so far, as SGLang's streams do."""
        exe, i = self.executor, 0
        sent: dict[str | None, int] = {}  # output logprobs already yielded, per variable
        while True:
            with exe.chunks_cond:
                while i >= len(exe.chunks) and not exe.done and exe.failure is None:
                    exe.chunks_cond.wait(0.1)
                batch, i = exe.chunks[i:], len(exe.chunks)
                finished = exe.done or exe.failure is not None
            for var, text, meta in batch:
                if var_name is None or var == var_name:
                    if return_meta_data and meta and meta.get("output_token_logprobs") is not None:
                        # as SGLang's stream: each chunk the logprobs of its new tokens, and how many in all
                        full = meta["output_token_logprobs"]
                        meta = {**meta, "output_token_logprobs": full[sent.get(var, 0):],
                                "output_token_logprobs_length": len(full)}
                        sent[var] = len(full)
                    yield (text, meta) if return_meta_data else text
            if finished and i >= len(exe.chunks):
                exe.raise_error()
                return

    async def text_async_iter(self, var_name: str | None = None, return_meta_data: bool = False) -> AsyncIterator[Any]:
        it = self.text_iter(var_name, return_meta_data)
        sentinel = object()
        while True:
            chunk = await asyncio.to_thread(next, it, sentinel)
            if chunk is sentinel:
                return
            yield chunk

    def __repr__(self) -> str:
        exe = self.executor
        return f"ProgramState({exe.id}, text={exe.text_[-60:]!r}, vars={sorted(exe.variables)})"


class CopiedState(ProgramState):
    """What `s.copy()` returns: a branch, and SGLang's context manager that joins it back (gather_variable) when
    its `with` block ends without an error (with one, the branch just ends)."""

    group: ProgramStateGroup

    def __enter__(self) -> CopiedState:
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: Any) -> None:
        if exc_type is None:
            self.group.join()
        else:
            self.executor.end()


class ProgramStateGroup:
    """The branches of a fork. Index or iterate them; `join()` brings their results back."""

    def __init__(self, states: list[ProgramState], parent: ProgramState) -> None:
        self.states = states
        self.parent = parent

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.states)

    def __setitem__(self, i: int, value: ProgramState) -> None:
        """What `forks[i] += x` stores back: branch i itself (appended to in place). Branches are fixed."""
        if value is not self.states[i]:
            raise TypeError("a fork's branches cannot be replaced: append to one with forks[i] += ...")

    def __iadd__(self, other: Any) -> ProgramStateGroup:
        """`forks += x` appends x to every branch (a list appends one item per branch; a callable, as in
        SGLang, is called with each branch's index and its result appended to that branch)."""
        if callable(other) and not isinstance(other, ir.Node):
            for i, s in enumerate(self.states):
                s += other(i)
            return self
        if isinstance(other, (list, tuple)):
            if len(other) != len(self.states):
                raise ValueError(f"{len(other)} items for {len(self.states)} branches")
            for s, o in zip(self.states, other):
                s += o
        else:
            for s in self.states:
                s += other
        return self

    def join(self, mode: str = "gather_variable") -> None:
        """gather_variable: each variable set in the branches becomes a list in the parent.
        concate_and_append: the branches' new text is appended to the parent, in order."""
        for s in self.states:
            s.sync()
        if mode == "gather_variable":
            before = set(self.parent.executor.variables)
            names: list[str] = []
            for s in self.states:
                names += [k for k in s.executor.variables if k not in before and k not in names]
            for name in names:
                self.parent.executor.set_var(name, [s.executor.variables.get(name) for s in self.states])
        elif mode == "concate_and_append":
            self.parent += ir.ConcateAndAppend(tuple(self.states), where=user_location())
        else:
            raise ValueError(f"join mode must be 'gather_variable' or 'concate_and_append', got {mode!r}")
        for s in self.states:
            s.executor.end()
