"""The program IR: every primitive a program appends to its state is one frozen node.

Nodes carry no behaviour; the interpreter dispatches on their type through a table. `where` is the user's
source line that created the node, so errors point at the program, not at sgnb.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sgnb.sampling import GenParams
from sgnb.tools import ToolPlan


@dataclass(frozen=True)
class Node:
    where: str | None = field(default=None, compare=False, kw_only=True)

    def __add__(self, other: Any) -> Sequence:  # gen(...) + "text"
        return Sequence((self, _node(other)), where=self.where)

    def __radd__(self, other: Any) -> Sequence:  # "text" + gen(...)
        return Sequence((_node(other), self), where=self.where)


def _node(value: Any) -> Node:
    if isinstance(value, Node):
        return value
    if isinstance(value, str):
        return Text(value)
    raise TypeError(f"cannot combine a {type(value).__name__} with an sgnb primitive")


@dataclass(frozen=True)
class Text(Node):
    text: str


@dataclass(frozen=True)
class Gen(Node):
    name: str | None
    params: GenParams
    dtype: type | None = None  # int | float | str | bool: a typed value (needs constrained decoding)
    tools: ToolPlan | None = None  # gen(tools=...): the reply may (or must) be a call of one of them


@dataclass(frozen=True)
class Select(Node):
    name: str | None
    choices: tuple[str, ...]
    temperature: float = 0.0
    choices_method: str = "token_length_normalized"


@dataclass(frozen=True)
class RoleBegin(Node):
    role: str
    tool_call_id: str | None = None  # a "tool" message: the call it answers (None: the next unanswered one)


@dataclass(frozen=True)
class RoleEnd(Node):
    role: str


@dataclass(frozen=True)
class Tools(Node):
    """The descriptions of `plan`'s tools, in a system message (system(..., tools=[...]))."""

    plan: ToolPlan


@dataclass(frozen=True)
class Image(Node):
    path: Any  # a path, a PIL image, a uint8 array, bytes, a data: URL or an http(s) URL (see sgnb.media)


@dataclass(frozen=True)
class Video(Node):
    path: Any  # a file path or an http(s) URL
    num_frames: int = 8


@dataclass(frozen=True)
class VarScopeBegin(Node):
    name: str


@dataclass(frozen=True)
class VarScopeEnd(Node):
    name: str


@dataclass(frozen=True)
class ConcateAndAppend(Node):
    states: tuple[Any, ...]  # ProgramStates whose texts are appended, in order


@dataclass(frozen=True)
class SeparateReasoning(Node):
    """Split the reasoning off the named gens/selects just run: `names` (those inside the wrapped expression)."""

    names: tuple[str, ...]
    model_type: str | None = None


@dataclass(frozen=True)
class Sequence(Node):
    """Several nodes appended by one `+=` (e.g. `sgl.user("hi")` = begin, text, end)."""

    items: tuple[Node, ...]
