"""Gen and select, the nodes that call the model (a mixin of StreamExecutor): `gen` (plain, n samples,
streamed, typed, with tools), `select`, a role's tool descriptions, and the GenContext each request is sent with.

Contract: as every node handler, these run only from `StreamExecutor._execute`, on the pool thread draining the
state's queue, in node order; they change the state only through its own methods (`_append` for text, which
streams it, `_set_var` for variables, `emit` for views' events), its role fields and `current_rid` (the
request in flight, which `_context` names); an exception fails the program at the node's line. A gen sets its variable once its reply is whole, with its meta_info; an aborted
gen keeps what it wrote. The helpers below (`_small_meta`: what a gen_end or select event carries) are theirs.

Tool calls (`gen(tools=...)`, sgnb.tools has the format): on a completion-style backend the interpreter decodes
them through plain generate calls by sgnb.tool_decode's steps, as `sgnb serve` does ("required": the text gets
<tool_call>, then one call constrained by the tools' schemas, then </tool_call>; "auto": text that stops where a
call opens, then the call); a chat backend (`is_chat_model`) is sent the tools and returns OpenAI's tool_calls,
written into the text in sgnb's format. Either way the message of the open role keeps the text as content minus
what is not content (tool descriptions, calls), with `tool_calls`; a "tool" message carries the `tool_call_id` it
answers.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import time
from typing import TYPE_CHECKING, Any

from sgnb import ir
from sgnb.backends.base import BackendError, ChoiceDecision, GenContext, RequestAborted
from sgnb.engine.meta_info import MetaInfo, meta_subset
from sgnb.engine.request_input import new_rid
from sgnb.program_events import GenBeginEvent, GenEndEvent, SelectEvent
from sgnb.reasoning import ReasoningFormat, reasoning_format
from sgnb.sampling import DEFAULT_PARAMS, GenParams
from sgnb.tool_decode import CallStep, decode_tool_call
from sgnb.tools import ToolPlan, call_text

if TYPE_CHECKING:
    from sgnb.interpreter import StreamExecutor

# typed gens are constrained by a regex (the grammar backend enforces it), written so that a typed gen inside a
# JSON template stays valid JSON: numbers as JSON writes them (no leading zeros or "+", a digit before the point;
# SGLang's pattern allowed "0014", which a 135M model wrote in SGLang's test_decode_json), strings of words,
# digits and spaces in quotes (SGLang's \s also admits newlines and tabs, which a JSON string may not hold raw).
DTYPE_REGEX = {int: r"-?(0|[1-9][0-9]*)", float: r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?",
               bool: r"(True|False)", str: r"\"[\w\d ]*\""}


class GenHandlers:
    """StreamExecutor's gen, select and tools nodes, and the context of a request."""

    current_rid: str | None  # StreamExecutor's field (set up in its __init__): the request in flight

    def _context(self: StreamExecutor) -> GenContext:
        self.current_rid = f"{self.id}-{new_rid()}"
        messages = list(self.messages_)
        if self.cur_role is not None:  # an open role: its content so far is the last message
            messages.append(self._role_message())
        return GenContext(self.text_, messages, self.current_rid, list(self.images_), self.program_scratch,
                          self.num_api_spec_tokens, self.cur_role, self.stream_interval_s)

    def _gen(self: StreamExecutor, node: ir.Gen) -> None:
        params = node.params.merged(self.defaults)
        if node.dtype is not None:
            params = dataclasses.replace(params, regex=DTYPE_REGEX[node.dtype])
        ctx = self._context()
        begin = len(self.text_)
        self.emit(GenBeginEvent(program=self.id, parent=self.parent_id, type="gen_begin", var=node.name, rid=ctx.rid,
                                where=node.where, constraint=params.regex or params.json_schema or params.ebnf,
                                constraint_name=_schema_title(params.json_schema),
                                reasoning=self.reasoning_vars.get(node.name) if node.name is not None else None))
        value: Any
        try:
            if node.tools is not None:
                value, meta = self._gen_tools(node.name, node.tools, params, ctx)
            elif (params.n or 1) > 1:
                samples = self.backend.generate_samples(ctx, params)
                texts, metas = [t for t, _ in samples], [m for _, m in samples]
                self._append(texts[0], node.name, metas[0])  # the program goes on with the first, as in SGLang
                value = [_convert(t, node.dtype) for t in texts] if node.dtype is not None else texts
                meta = {**metas[0], "samples": metas}
            else:
                if self.stream:
                    value, meta = self._gen_stream(node.name, ctx, params)
                else:
                    value, meta = self.backend.generate(ctx, params)
                    self._append(value, node.name, meta)
                if node.dtype is not None:
                    value = _convert(value, node.dtype)
        except RequestAborted as e:
            if not self.aborted:
                raise
            # interrupted: the gen keeps what it wrote (its variable holds the partial text, its meta_info says
            # it was aborted), and the program stops here
            self._append(e.text, node.name, e.meta)
            self._end_gen(node.name, ctx, self.text_[begin:], e.meta)
            raise
        self._end_gen(node.name, ctx, value, meta)

    def _end_gen(self: StreamExecutor, name: str | None, ctx: GenContext, value: Any, meta: MetaInfo) -> None:
        # prompt_chars: the prompt's length in characters (views place the cached part of the prompt with it)
        self.emit(GenEndEvent(program=self.id, parent=self.parent_id, type="gen_end", var=name, rid=ctx.rid,
                              meta_info=_small_meta(meta), prompt_chars=len(ctx.text)))
        if name is not None:
            self.meta_info[name] = meta
            self._set_var(name, value)

    def _gen_stream(self: StreamExecutor, name: str | None, ctx: GenContext, params: GenParams) -> tuple[str, MetaInfo]:
        # each piece goes out when the next non-empty one arrives, so the last carries the gen's whole
        # meta_info even when the stream ends with an empty piece (text_iter's pairs then add up)
        pieces: list[str] = []
        meta: MetaInfo = {}
        held, held_meta = "", meta
        try:
            for piece, meta in self.backend.generate_stream(ctx, params):  # noqa: B007 (last meta is kept)
                pieces.append(piece)
                if piece and held:
                    self._append(held, name, held_meta)
                    held = ""
                held, held_meta = held + piece, meta
        except RequestAborted as e:
            e.text = held + e.text  # what was not appended yet
            raise
        self._append(held, name, meta)
        return "".join(pieces), meta

    def _gen_tools(self: StreamExecutor, name: str | None, plan: ToolPlan, params: GenParams,
                   ctx: GenContext) -> tuple[str, MetaInfo]:
        """A gen that may (or must) call a tool. Returns the text it appended and its meta_info, whose
        "tool_calls" holds the calls (OpenAI's shape; [] for a text reply or a call cut short by max_tokens)."""
        begin = len(self.text_)
        if self.backend.is_chat_model:  # the API decodes the call; its calls go into the text in sgnb's format
            content, calls, meta = self.backend.generate_tool_call(ctx, params, plan)
            self._append(content, name, meta)
            start = len(self.text_)
            self._append("\n".join(call_text(c["function"]["name"], _arguments(c)) for c in calls), name)
            if calls:
                self._hide(start, calls)
            return self.text_[begin:], {**meta, "tool_calls": calls}
        sp = params.values()
        # max_new_tokens bounds the whole reply: the call gets what the text left of it
        sp["max_new_tokens"] = params.max_new_tokens or DEFAULT_PARAMS.max_new_tokens
        thinking = self._thinks_first(name, ctx)
        progress: MetaInfo = {}

        def generate(step: CallStep) -> tuple[str, MetaInfo]:
            nonlocal progress
            self._append(step.prefix[len(self.text_) - begin:], name, progress or None)
            # the gen's first request has its context (gen_begin told its rid); a later one continues the text
            here = ctx if len(self.text_) == begin and self.current_rid == ctx.rid else self._context()
            text, progress = self.backend.generate(here, _sampling(step.params))
            return text, progress

        reply = decode_tool_call(plan, sp, generate, thinking.close if thinking is not None else None)
        self._append(reply.text[len(self.text_) - begin:], name, reply.meta)
        if reply.call is not None:
            self._hide(begin + reply.call_start, [reply.call])
        return self.text_[begin:], {**reply.meta, "tool_calls": [reply.call] if reply.call is not None else []}

    def _thinks_first(self: StreamExecutor, name: str | None, ctx: GenContext) -> ReasoningFormat | None:
        """The reasoning format a gen's reply starts with: a separate_reasoning around it, else the backend's
        reasoning parser; None when neither, or when the prompt closed the block itself (thinking turned off)."""
        fmt_name = self.reasoning_vars.get(name) if name is not None else None
        fmt_name = fmt_name or getattr(self.backend, "reasoning_parser", None)
        if fmt_name is None:
            return None
        fmt = reasoning_format(fmt_name)
        return None if ctx.text.rstrip().endswith(fmt.close) else fmt

    def _hide(self: StreamExecutor, start: int, calls: list[dict[str, Any]]) -> None:
        """text_[start:] holds `calls`: it is not the open role's content, and the message carries the calls."""
        if self.cur_role is not None:
            self.role_hidden.append((start, len(self.text_)))
            self.role_calls.extend(calls)

    def _tools(self: StreamExecutor, node: ir.Tools) -> None:
        if self.cur_role is None:
            raise ValueError("tool descriptions go inside a message: system(..., tools=[...])")
        text = self.chat_template.tools_text(node.plan.tools, node.plan.functions,
                                             after_content=len(self.text_) > self.cur_role_begin)
        start = len(self.text_)
        self._append(text)
        self.role_hidden.append((start, len(self.text_)))

    def _select(self: StreamExecutor, node: ir.Select) -> None:
        ctx = self._context()
        t0 = time.perf_counter()
        decision = self.backend.select(ctx, list(node.choices), node.temperature, node.choices_method)
        if node.temperature > 0:
            decision = _sample_choice(decision, list(node.choices), node.temperature, node.choices_method)
        elapsed = time.perf_counter() - t0
        self._append(decision.decision, node.name)
        # meta_info: its prompt and cached tokens (summed over the choices' scoring requests), for the metrics
        self.emit(SelectEvent(program=self.id, parent=self.parent_id, type="select", var=node.name,
                              choice=decision.decision, choices=list(node.choices),
                              normalized_prompt_logprobs=decision.meta_info.get("normalized_prompt_logprobs"),
                              meta_info=_small_meta(decision.meta_info), elapsed=elapsed))
        if node.name is not None:
            self.meta_info[node.name] = decision.meta_info
            self._set_var(node.name, decision.decision)


def _sampling(values: dict[str, Any]) -> GenParams:
    """GenParams of a tool plan's sampling values (its lists as tuples)."""
    return GenParams(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})  # type: ignore[arg-type]


def _arguments(call: dict[str, Any]) -> Any:
    """A call's arguments, parsed from their JSON string (kept as the string when it is not JSON)."""
    args = call["function"].get("arguments", "{}")
    try:
        return json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError:
        return args


def _convert(value: str, dtype: type) -> Any:
    text = value.strip()
    if dtype is bool:
        return text == "True"
    if dtype is str:
        return text[1:-1] if len(text) >= 2 and text[0] == text[-1] == '"' else text
    return dtype(text)


def _sample_choice(decision: ChoiceDecision, choices: list[str], temperature: float,
                   method: str) -> ChoiceDecision:
    """select(temperature > 0): a choice drawn with probabilities softmax(score / temperature) over the method's
    per-choice scores (Python's `random`: seed it to repeat a draw). The backends score; this draws, once for
    all of them."""
    meta = decision.meta_info
    key = ("normalized_unconditional_prompt_logprobs" if method == "unconditional_likelihood_normalized"
           else "normalized_prompt_logprobs")
    scores = meta.get(key)
    if not isinstance(scores, list) or len(scores) != len(choices):
        raise BackendError(f"select(temperature={temperature}) draws from the choices' scores ({key}), which this "
                           "backend did not return")
    top = max(scores)
    weights = [math.exp((v - top) / temperature) for v in scores]
    index = random.choices(range(len(choices)), weights)[0]
    total = sum(weights)
    return ChoiceDecision(choices[index], {**meta, "temperature": temperature,
                                           "choice_probs": [w / total for w in weights]})


def _schema_title(schema: str | None) -> str | None:
    """A JSON schema's title (a pydantic model's class name), which views show for the constraint."""
    if not schema:
        return None
    try:
        title = json.loads(schema).get("title")
    except (TypeError, ValueError, AttributeError):
        return None
    return title if isinstance(title, str) and title else None


def _small_meta(meta: MetaInfo) -> MetaInfo:
    """What a gen_end event carries for views: counts, timings (the engine's clock: ttft and e2e_latency both
    from the request's arrival), where the cache hit ends in the prompt's characters (cached_chars, from the
    engine), the output tokens as (text, forced) pairs and, when the gen asked for logprobs, their logprobs and
    top alternatives (the lists the backend returned, not copied)."""
    keys = ("prompt_tokens", "completion_tokens", "cached_tokens", "cached_chars", "finish_reason", "e2e_latency",
            "ttft", "decode_steps", "forced_tokens", "output_tokens", "output_token_logprobs", "output_top_logprobs")
    return meta_subset(meta, keys)
