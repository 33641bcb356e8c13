"""Program events: what a running program tells its subscribers (views), one TypedDict per kind.

A program's executor (`sgnb.interpreter.StreamExecutor`) calls each subscriber given to `fn.run(...,
subscribers=[...])` / `run_batch` / `run_on` with one plain dict per event, on the executor's thread (a subscriber
must be quick). Every event holds `program` (the executor's id) and `parent` (the id of the state it was forked
from, else None) besides its `type`:

| type | emitted by | when |
|---|---|---|
| program_begin | `SglFunction._run` (function.py); `StreamExecutor.continuation` (with `continues`, `text`) | a run starts; a finished state goes on |
| text | `StreamExecutor._append` | text joins the program (a gen's piece carries `var` and its `progress`) |
| gen_begin / gen_end | `StreamExecutor._gen` / `_end_gen` | a gen starts; it ended (its meta_info for views) |
| select | `StreamExecutor._select` | a select chose (after its choice's text event) |
| role_begin / role_end | `StreamExecutor._role_begin` / `_role_end` | a chat role opens / closes |
| image / video | `StreamExecutor._add_media` | an image / video joins the prompt (its token is in `text`) |
| reasoning | `StreamExecutor._separate_reasoning` | separate_reasoning split a gen into reasoning and answer |
| var | `StreamExecutor._set_var` | a variable got its value |
| fork | `StreamExecutor.fork` | the state forked into `children` (their events name it as `parent`) |
| error | `StreamExecutor.fail` | the program failed or was interrupted (the first failure only) |
| end | `StreamExecutor._close_stream` | the run is over (its subscribers are dropped) |

Consumers: `sgnb.widgets.ProgramView` (every kind: widgets/_program_view.py's handlers), `BatchView` (gen_begin,
gen_end, text, error, end: widgets/_batch_view.py) and the `%%sgl` magic, which feeds a ProgramView. Events travel
as plain dicts: these types are for the code on both sides (mypy), nothing checks them at run time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, TypedDict

from sgnb.engine.meta_info import MetaInfo

__all__ = ["EndEvent", "ErrorEvent", "ForkEvent", "GenBeginEvent", "GenEndEvent", "MediaEvent", "ProgramBeginEvent",
           "ProgramEvent", "ReasoningEvent", "RoleEvent", "SelectEvent", "Subscriber", "TextEvent", "VarEvent"]


class _Origin(TypedDict):
    program: str  # the executor's id ("p12"); a continuation's is new, its program_begin names the one it continues
    parent: str | None  # the id of the state this one was forked from; None for a program's own state


class _ProgramBegin(_Origin):
    type: Literal["program_begin"]
    name: str  # the program's (function's) name
    arguments: dict[str, str]  # its arguments by name, each as repr() (at most 200 characters)


class ProgramBeginEvent(_ProgramBegin, total=False):
    continues: str  # a continuation (run_on): the id of the finished state it goes on from
    text: str  # a continuation: that state's text so far


class _Text(_Origin):
    type: Literal["text"]
    text: str  # the text appended (never empty)
    var: str | None  # the gen's or select's variable whose text it is; None for other text


class TextEvent(_Text, total=False):
    progress: MetaInfo  # a gen's piece: its prompt_tokens, cached_tokens and completion_tokens so far


class GenBeginEvent(_Origin):
    type: Literal["gen_begin"]
    var: str | None  # the gen's variable
    rid: str  # its (first) request's id: the gen_end with the same rid ends it
    where: str | None  # the program line ("file:line: statement") of the gen() call
    constraint: str | None  # its regex, JSON schema or EBNF grammar, if any
    constraint_name: str | None  # the JSON schema's title (a pydantic model's name), if any
    reasoning: str | None  # the reasoning format's name when separate_reasoning wraps the gen


class GenEndEvent(_Origin):
    type: Literal["gen_end"]
    var: str | None
    rid: str
    meta_info: MetaInfo  # its counts, timings, cached_chars, output tokens and logprobs (interpreter_gen._small_meta)
    prompt_chars: int  # the prompt's length in characters (views place its cached part with it)


class SelectEvent(_Origin):
    type: Literal["select"]
    var: str | None
    choice: str  # the choice made
    choices: list[str]
    normalized_prompt_logprobs: list[float] | None  # per choice, its score (None: the backend gave none)
    meta_info: MetaInfo  # its prompt and cached tokens, summed over the choices' scoring requests
    elapsed: float  # seconds from the select's start to its decision


class RoleEvent(_Origin):
    type: Literal["role_begin", "role_end"]
    role: str  # "system", "user", "assistant" or "tool"


class _Media(_Origin):
    type: Literal["image", "video"]
    index: int  # its position among the state's images and videos (0-based)
    text: str  # the backend's image (video) token appended to the text
    source: str  # a short label: the path, URL or what the value is
    path: str  # the same label (what older views read)
    thumbnail: str | None  # a PNG data: URL of at most 96 px (a video's first frame); None for an http(s) URL


class MediaEvent(_Media, total=False):
    frames: list[str]  # a video's: a few frame thumbnails (PNG data: URLs), first to last
    num_frames: int  # a video's: the frames the model is given


class ReasoningEvent(_Origin):
    type: Literal["reasoning"]
    var: str  # the gen whose reply was split
    reasoning: str  # its reasoning (what `{var}_reasoning_content` holds)
    answer: str  # its answer (what the variable now holds)


class VarEvent(_Origin):
    type: Literal["var"]
    name: str  # the variable that was set


class ForkEvent(_Origin):
    type: Literal["fork"]
    children: list[str]  # the branches' program ids


class ErrorEvent(_Origin):
    type: Literal["error"]
    where: str | None  # the program line it failed at, when known
    interrupted: bool  # an interrupt (abort) stopped it, rather than an error of its own
    message: str  # "interrupted", else "Type: message"


class EndEvent(_Origin):
    type: Literal["end"]


ProgramEvent = (ProgramBeginEvent | TextEvent | GenBeginEvent | GenEndEvent | SelectEvent | RoleEvent | MediaEvent
                | ReasoningEvent | VarEvent | ForkEvent | ErrorEvent | EndEvent)
Subscriber = Callable[[ProgramEvent], None]  # what `subscribers=` takes: called with each event on the program's thread

# each kind's record (the test of the emitted events reads it)
EVENT_TYPES: dict[str, Any] = {
    "program_begin": ProgramBeginEvent, "text": TextEvent, "gen_begin": GenBeginEvent, "gen_end": GenEndEvent,
    "select": SelectEvent, "role_begin": RoleEvent, "role_end": RoleEvent, "image": MediaEvent, "video": MediaEvent,
    "reasoning": ReasoningEvent, "var": VarEvent, "fork": ForkEvent, "error": ErrorEvent, "end": EndEvent,
}
