"""Tracing: run a program body with placeholders instead of values, recording its IR without a model.

Arguments become placeholder strings and generated variables read back as placeholders, so string
formatting works; the constant prefix is the rendered text before the first placeholder or generation.
"""

from __future__ import annotations

from typing import Any

from sgnb import ir
from sgnb.backends.base import Backend
from sgnb.chat_template import PLAIN, ChatTemplate

_MARK = "\x00sgnb-placeholder:{}\x00"


class Placeholder(str):
    """A value unknown while tracing; it renders as a marker that stops the constant prefix."""

    def __new__(cls, name: str) -> Placeholder:
        return super().__new__(cls, _MARK.format(name))


class TracingState:
    def __init__(self, template: ChatTemplate) -> None:
        self.nodes: list[ir.Node] = []
        self.template = template
        self.ret_value: Any = None

    def __iadd__(self, other: Any) -> TracingState:
        from sgnb.state import as_node

        self.nodes.append(as_node(other))
        return self

    def __getitem__(self, name: str) -> Placeholder:
        return Placeholder(name)

    def get_var(self, name: str) -> Placeholder:
        return Placeholder(name)

    def __setitem__(self, name: str, value: Any) -> None:
        pass

    def __contains__(self, name: str) -> bool:
        return True

    def _role(self, role: str, content: Any = None) -> Any:
        import contextlib

        from sgnb.state import as_node

        if content is not None:
            self.nodes += [ir.RoleBegin(role), as_node(content), ir.RoleEnd(role)]
            return None

        @contextlib.contextmanager
        def scope():
            self.nodes.append(ir.RoleBegin(role))
            yield
            self.nodes.append(ir.RoleEnd(role))

        return scope()

    def system(self, content: Any = None) -> Any:
        return self._role("system", content)

    def user(self, content: Any = None) -> Any:
        return self._role("user", content)

    def assistant(self, content: Any = None) -> Any:
        return self._role("assistant", content)

    def fork(self, size: int = 1, position_ids_offset: Any = None) -> Any:
        raise _StopTrace  # what follows a fork depends on the branches: the prefix ends here

    def sync(self) -> TracingState:
        return self

    def text(self) -> str:
        raise _StopTrace


class _StopTrace(Exception):
    pass


def _flatten(nodes: list[ir.Node]) -> list[ir.Node]:
    out: list[ir.Node] = []
    for n in nodes:
        out.extend(_flatten(list(n.items)) if isinstance(n, ir.Sequence) else [n])
    return out


def constant_prefix(nodes: list[ir.Node], template: ChatTemplate) -> str:
    text, open_role = "", False
    for node in _flatten(nodes):
        if isinstance(node, ir.Text):
            cut = node.text.find("\x00sgnb-placeholder:")
            if cut >= 0:
                return text + node.text[:cut]
            text += node.text
        elif isinstance(node, ir.RoleBegin):
            if node.role == "user" and template.default_system_prompt and not text.strip():
                p, s = template.prefix_and_suffix("system")
                text += p + template.default_system_prompt + s
            text += template.prefix_and_suffix(node.role)[0]
            open_role = True
        elif isinstance(node, ir.RoleEnd):
            text += template.prefix_and_suffix(node.role)[1]
            open_role = False
        else:
            break
    del open_role
    return text


def trace_program(function: Any, backend: Backend | None, kwargs: dict[str, Any]) -> Any:
    from sgnb.function import TracedProgram

    template = backend.get_chat_template() if backend is not None else PLAIN
    state = TracingState(template)
    arguments = {name: kwargs.get(name, Placeholder(name)) for name in function.arg_names}
    arguments.update(function.bind_arguments)
    try:
        state.ret_value = function.func(state, **arguments)
    except _StopTrace:
        pass
    return TracedProgram(function.__name__, state.nodes, constant_prefix(state.nodes, template))
