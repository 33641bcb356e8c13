"""Tracing: run a program body with placeholders instead of values, recording its IR without a model.

The body gets a TracingState: a ProgramState (so roles, var_scope and nested programs behave as in a run) over
a recording executor. Arguments become placeholder strings and variables read back as placeholders, so string
formatting works. The constant prefix is the text the interpreter itself renders for the nodes before the first
placeholder or generation (role prefixes and the default system prompt included: one implementation of those).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NoReturn

from sgnb import ir
from sgnb.backends.base import Backend
from sgnb.chat_template import PLAIN, ChatTemplate
from sgnb.interpreter import StreamExecutor
from sgnb.state import ProgramState

_MARK = "\x00sgnb-placeholder:"


class Placeholder(str):
    """A value unknown while tracing; it renders as a marker that stops the constant prefix."""

    def __new__(cls, name: str) -> Placeholder:
        return super().__new__(cls, f"{_MARK}{name}\x00")


class _StopTrace(Exception):
    """What follows depends on values only a run knows: the trace (and the prefix) ends here."""


class _Recorder(StreamExecutor):
    """A program's executor while tracing. It calls no model: it records every node, and runs the leading
    text and role nodes through the interpreter's own handlers (so `text_` is exactly what a run renders) up
    to the first node or placeholder it cannot know."""

    def __init__(self, backend: Backend | None, template: ChatTemplate) -> None:
        super().__init__(backend or Backend(), use_thread=False, chat_template=template)
        self.nodes: list[ir.Node] = []
        self.constant = True  # still inside the constant prefix

    def submit(self, node: ir.Node) -> None:
        self.nodes.append(node)
        for item in _flatten([node]):
            if not self.constant:
                return
            if isinstance(item, ir.Text) and _MARK in item.text:
                self._append(item.text[:item.text.index(_MARK)])
                self.constant = False
            elif isinstance(item, (ir.Text, ir.RoleBegin, ir.RoleEnd, ir.Tools)):
                try:
                    self._execute(item)
                except ValueError:  # a misplaced role: the run fails there, so the prefix ends there
                    self.constant = False
            else:
                self.constant = False

    def get_var(self, name: str, timeout: float | None = None) -> Placeholder:
        return Placeholder(name)

    def set_var(self, name: str, value: Any) -> None:
        pass

    def fork(self, n: int) -> list[StreamExecutor]:
        raise _StopTrace  # what follows a fork depends on the branches


class TracingState(ProgramState):
    """The `s` a traced body gets. Reading what only a run knows (the text, messages, metadata, a fork's
    branches) ends the trace; a variable reads back as its placeholder."""

    executor: _Recorder

    def __init__(self, backend: Backend | None, template: ChatTemplate) -> None:
        super().__init__(_Recorder(backend, template))

    def __contains__(self, name: str) -> bool:
        return True

    def text(self) -> NoReturn:
        raise _StopTrace

    def messages(self) -> NoReturn:
        raise _StopTrace

    def variables(self) -> NoReturn:
        raise _StopTrace

    def get_meta_info(self, name: str) -> NoReturn:
        raise _StopTrace

    def text_iter(self, var_name: str | None = None, return_meta_data: bool = False) -> Iterator[Any]:
        raise _StopTrace

    def text_async_iter(self, var_name: str | None = None, return_meta_data: bool = False) -> Any:
        raise _StopTrace


def _flatten(nodes: list[ir.Node]) -> list[ir.Node]:
    out: list[ir.Node] = []
    for n in nodes:
        out.extend(_flatten(list(n.items)) if isinstance(n, ir.Sequence) else [n])
    return out


def trace_program(function: Any, backend: Backend | None, kwargs: dict[str, Any]) -> Any:
    from sgnb.function import TracedProgram

    template = backend.get_chat_template() if backend is not None else PLAIN
    state = TracingState(backend, template)
    arguments = {name: kwargs.get(name, Placeholder(name)) for name in function.arg_names}
    arguments.update(function.bind_arguments)
    try:
        state.ret_value = function.func(state, **arguments)
    except _StopTrace:
        pass
    return TracedProgram(function.__name__, _flatten(state.executor.nodes), state.executor.text_)
