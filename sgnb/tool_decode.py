"""The tool-call decode protocol over a completion-style engine: one implementation for `gen(tools=...)` (the
interpreter, against `backend.generate`) and `sgnb serve`'s chat tool calls (against the engine, streamed or not).

`tool_steps(plan, sp, after)` is the protocol as a generator: it yields each request to make (a CallStep: the text to
decode after, the sampling values), is sent what that request decoded (text, meta_info), and returns the ToolReply.
It decides every step, the budget and the parse; the caller only generates. `decode_tool_call` drives it with a
synchronous `generate`; the server drives it itself, streaming the text step's chunks as they come.

Steps (sgnb.tools has the format and the plan's sampling values):
- "required": one request after the opened "<tool_call>\\n" (given, not decoded), under the call's schema.
- "required" from a model that thinks first (`after`: the reasoning's closing marker): one request, free up to
  `after` and under the call's schema from there (the engine's grammar_after).
- "auto": a text request (`text_params`: it stops where a call opens); where it opened one (`opened_call`), a second
  request for the call after the text (and "<tool_call>\\n" when the model tagged it), within what is left of
  max_new_tokens. Its meta_info is both requests' joined.

No torch: `import sgnb` imports this.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, cast

from sgnb.engine.meta_info import FinishReason, MetaInfo
from sgnb.tools import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, ToolPlan, joined_meta, opened_call, parse_call

Decoded = tuple[str, MetaInfo]  # what a request decoded: its text and its meta_info


@dataclass(frozen=True)
class CallStep:
    """One request of a tool-call reply: decode after the prompt + `prefix` (the reply so far, ending with the
    opened "<tool_call>\\n" where the call is given its opening) with the sampling values `params`. `streamed`: its
    text is the reply's content as it comes (a stream may send it on); else the request is read whole."""

    prefix: str
    params: dict[str, Any]
    streamed: bool = False


@dataclass(frozen=True)
class ToolReply:
    """A decoded reply. `text`: the reply as it continues the prompt (its content, then the call in sgnb's format);
    `content`: what a chat API answers as the message's content; `call`: OpenAI's tool_calls entry, None for a text
    reply or a call cut short by max_tokens; `call_start`: where in `text` the call begins (len(text) when there is
    none); `meta`: the meta_info of its requests, joined."""

    text: str
    content: str
    call: dict[str, Any] | None
    call_start: int
    meta: MetaInfo


def tool_steps(plan: ToolPlan, sp: dict[str, Any],
               after: str | None = None) -> Generator[CallStep, Decoded, ToolReply]:
    """The requests of one reply that may (or must) call a tool, and the reply they make (module docstring). `sp`:
    the request's sampling values (its max_new_tokens bounds the whole reply); `after`: the reasoning's closing
    marker when the reply starts by thinking (it applies to a required call)."""
    if plan.mode == "required" and after is not None:
        raw, meta = yield CallStep("", {**plan.call_params(sp), "grammar_after": after})
        end = raw.find(after)
        body = raw[end + len(after):].strip()
        call = parse_call(body, plan) if end >= 0 else None
        if call is None:  # cut off while thinking, or never closed the block: the text as it came
            return ToolReply(raw, raw, None, len(raw), meta)
        reasoning = raw[: end + len(after)]
        text = f"{reasoning}\n\n{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"
        return ToolReply(text, reasoning, call, len(reasoning), meta)
    content, opening, first = "", TOOL_CALL_OPEN + "\n", None
    budget: int | None = None
    if plan.mode == "auto":
        text, first = yield CallStep("", plan.text_params(sp), streamed=True)
        opened = opened_call(first.get("finish_reason"))
        if opened is None:
            return ToolReply(text, text, None, len(text), first)
        content = _before_call(text, first)
        opening = opening if opened == "tagged" else ""  # a bare call object is decoded from its start
        limit = sp.get("max_new_tokens")
        budget = None if limit is None else limit - int(first.get("completion_tokens") or 0)
    raw, meta = yield CallStep(content + opening, plan.call_params(sp, budget))
    call = parse_call(raw, plan)
    meta = joined_meta(first, meta) if first is not None else meta
    if call is None:  # cut short: the raw text is content, less a required call's opening (the prompt's)
        shown = content + (opening if first is not None else "") + raw
        return ToolReply(content + opening + raw, shown, None, len(content + opening + raw), meta)
    close = "\n" + TOOL_CALL_CLOSE if opening else ""
    return ToolReply(content + opening + raw + close, content, call, len(content), meta)


def decode_tool_call(plan: ToolPlan, sp: dict[str, Any], generate: Callable[[CallStep], Decoded],
                     after: str | None = None) -> ToolReply:
    """`tool_steps` driven by `generate(step)`, which makes one request and returns what it decoded."""
    steps = tool_steps(plan, sp, after)
    step = next(steps)
    while True:
        try:
            step = steps.send(generate(step))
        except StopIteration as done:
            return done.value


def _before_call(text: str, meta: MetaInfo) -> str:
    """The text request's text before the call it opened (with no_stop_trim the text still ends with the match)."""
    matched = cast(str, cast(FinishReason, meta["finish_reason"])["matched"])  # the string that opened the call
    return text[: -len(matched)] if matched and text.endswith(matched) else text
