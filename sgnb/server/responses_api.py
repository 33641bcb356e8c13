"""OpenAI's Responses API (/v1/responses), as SGLang and vLLM serve it, over the chat route's machinery.

A request becomes a chat completion request (`chat_body`: `instructions` and `input` as messages, function
tools and tool_choice in the chat shape, `text.format` as response_format, `max_output_tokens` as max_tokens) and
runs as one: the same prompt rendering, constraints, reasoning split and tool calls (`OpenAIRoutes._chat_job`,
`_choice_streams`). What differs is only the answer's shape: output items (a "reasoning" item when the server
splits reasoning, a "message" with one output_text part, a "function_call" per call) and, when streaming,
OpenAI's typed events (response.created, response.in_progress, response.output_item.added,
response.content_part.added, response.output_text.delta / .done, response.function_call_arguments.delta /
.done, response.output_item.done, then response.completed, or response.incomplete when max_output_tokens cut
the reply). Stateless: nothing is stored, so previous_response_id, conversation and background are a 400.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from sgnb.engine.meta_info import FinishReason, MetaInfo
from sgnb.reasoning import ReasoningFormat, ReasoningStream, split_reasoning
from sgnb.server.media import _Media
from sgnb.server.openai_api import OpenAIRoutes, _ChatJob
from sgnb.server.protocol import (
    APIError,
    ChatCompletionRequest,
    ResponsesRequest,
    _dumps,
    _engine_error,
    _json_body,
    _json_response,
    _raise_failed,
    _tool_plan,
    _usage,
    _validate,
)
from sgnb.server.streaming import EventStream, _merge

# Responses fields that carry over to the chat request under the same name (sampling values, SGLang's extras)
_SAME_NAMES = ("model", "temperature", "top_p", "stream", "parallel_tool_calls", "user", "metadata", "top_k",
               "min_p", "repetition_penalty", "seed", "frequency_penalty", "presence_penalty", "stop",
               "chat_template_kwargs")
_TEXT_PARTS = ("input_text", "output_text", "text", "refusal")


class ResponsesRoutes(OpenAIRoutes):
    """POST /v1/responses."""

    async def responses(self, request: Request) -> Response:
        req: ResponsesRequest = _validate(ResponsesRequest, await _json_body(request))
        for name in ("previous_response_id", "conversation", "background"):
            if getattr(req, name):
                raise APIError(400, f"not supported yet: {name} (this server stores no responses: send the whole "
                                    "conversation as input)", param=name)
        chat: ChatCompletionRequest = _validate(ChatCompletionRequest, chat_body(req))
        self._check_model(chat.model)
        plan = _tool_plan(chat.tools, chat.tool_choice)
        self._check_constraint(chat, plan)
        job = await self._chat_job(chat, _Media(self.engine), plan, "resp_")
        if not req.stream:
            [(content, final)] = await self._collect_choices(request, job)
            items = _output_items(content, final, job.fmt, job.base)
            return _json_response(_response_object(req, job, items, final))
        [stream] = await self._choice_streams(request, job)
        return EventStream(self._response_events(req, job, stream))  # type: ignore[return-value]

    async def _response_events(self, req: ResponsesRequest, job: _ChatJob,
                               stream: AsyncIterator[dict]) -> AsyncIterator[bytes]:
        """The Responses stream: typed events, each with its sequence_number; text deltas as they decode (the
        reasoning as response.reasoning_text.delta when the server splits it), a tool call whole once decoded."""
        events = _EventWriter(job.base)
        splitter = ReasoningStream(job.fmt) if job.fmt is not None else None
        final: dict[str, Any] = {}
        with self.inflight.track(job.ids):
            try:
                yield events.emit("response.created", response=_response_object(req, job, [], None))
                yield events.emit("response.in_progress", response=_response_object(req, job, [], None))
                async with contextlib.aclosing(_merge([stream])) as chunks:
                    async for _, chunk in chunks:
                        last = "output_ids" in chunk
                        reasoning, answer = ("", chunk["text"]) if splitter is None else splitter.feed(chunk["text"])
                        if last and splitter is not None:
                            more_r, more_a = splitter.finish()
                            reasoning, answer = reasoning + more_r, answer + more_a
                        for data in events.text("reasoning", reasoning):
                            yield data
                        for data in events.text("message", answer):
                            yield data
                        if last:
                            final = chunk
                            _raise_failed([chunk])
                calls = final.get("tool_calls") or []
                if not calls and not events.wrote_message:  # an empty reply is still one message
                    for data in events.text("message", "", force=True):
                        yield data
                for data in events.close():
                    yield data
                for call in calls:
                    for data in events.function_call(call):
                        yield data
                done = _response_object(req, job, events.items, final)
                kind = "response.completed" if done["status"] == "completed" else "response.incomplete"
                yield events.emit(kind, response=done)
            except Exception as e:
                err = e if isinstance(e, APIError) else _engine_error(e)
                yield events.emit("error", code=str(err.code), message=err.message, param=err.param,
                                  error={"message": err.message, "type": err.type, "code": err.code})


class _EventWriter:
    """The Responses stream's events and the output items they build: at most one item open at a time (the
    reasoning, then the message), each closed with its .done events before the next opens."""

    def __init__(self, base: str) -> None:
        self.base, self.seq = base, 0
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None
        self.open_text = ""
        self.wrote_message = False

    def emit(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + _dumps(data) + b"\n\n"

    def text(self, kind: str, delta: str, force: bool = False) -> list[bytes]:
        """A text delta of a "reasoning" or "message" item, opening it (and closing the other) first."""
        if not delta and not force:
            return []
        out: list[bytes] = []
        if self.open is None or self.open["type"] != kind:
            out += self.close()
            index = len(self.items)
            item = _reasoning_item(self.base, index, "") if kind == "reasoning" else _message_item(self.base, index, "")
            self.open, self.open_text = item, ""
            self.wrote_message = self.wrote_message or kind == "message"
            out.append(self.emit("response.output_item.added", output_index=index,
                                 item={**item, "status": "in_progress", "content": []}))
            out.append(self.emit("response.content_part.added", item_id=item["id"], output_index=index,
                                 content_index=0, part=_part(kind, "")))
        if delta:
            self.open_text += delta
            name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
            out.append(self.emit(name, item_id=self.open["id"], output_index=len(self.items), content_index=0,
                                 delta=delta, **({"logprobs": []} if kind == "message" else {})))
        return out

    def close(self) -> list[bytes]:
        """The open item's .done events; it joins `items`."""
        if self.open is None:
            return []
        kind, text, index = self.open["type"], self.open_text, len(self.items)
        item = _reasoning_item(self.base, index, text) if kind == "reasoning" else _message_item(self.base, index, text)
        item["id"] = self.open["id"]
        done = "response.reasoning_text.done" if kind == "reasoning" else "response.output_text.done"
        out = [self.emit(done, item_id=item["id"], output_index=index, content_index=0, text=text,
                         **({"logprobs": []} if kind == "message" else {})),
               self.emit("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                         part=_part(kind, text)),
               self.emit("response.output_item.done", output_index=index, item=item)]
        self.items.append(item)
        self.open = None
        return out

    def function_call(self, call: dict[str, Any]) -> list[bytes]:
        index = len(self.items)
        item = _call_item(self.base, index, call)
        self.items.append(item)
        return [self.emit("response.output_item.added", output_index=index,
                          item={**item, "arguments": "", "status": "in_progress"}),
                self.emit("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                          delta=item["arguments"]),
                self.emit("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                          name=item["name"], arguments=item["arguments"]),
                self.emit("response.output_item.done", output_index=index, item=item)]


# ---- request and response shapes ------------------------------------------------------------------------------
def chat_body(req: ResponsesRequest) -> dict[str, Any]:
    """The chat completion request a Responses request means (validated as one afterwards)."""
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    messages += _input_messages(req.input)
    body: dict[str, Any] = {k: getattr(req, k) for k in _SAME_NAMES if getattr(req, k) is not None}
    body["messages"] = messages
    if req.max_output_tokens is not None:
        body["max_tokens"] = req.max_output_tokens
    if req.tools is not None:
        body["tools"] = [_chat_tool(t, i) for i, t in enumerate(req.tools)]
    if req.tool_choice is not None:
        choice = req.tool_choice
        if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
            choice = {"type": "function", "function": {"name": choice.get("name")}}
        body["tool_choice"] = choice
    fmt = (req.text or {}).get("format")
    if fmt is not None:
        body["response_format"] = _chat_response_format(fmt)
    return body


def _chat_tool(tool: Any, i: int) -> dict[str, Any]:
    """A Responses function tool {"type": "function", "name", "description", "parameters"} in the chat shape."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
        raise APIError(400, f"not supported yet: tools[{i}] of type {kind!r} (function tools only)", param="tools")
    if "function" in tool:  # the chat shape, sent here by mistake: taken as it is
        return tool
    fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
    return {"type": "function", "function": fn}


def _chat_response_format(fmt: Any) -> Any:
    """text.format -> response_format: {"type": "json_schema", "name", "schema", ...} nests under json_schema."""
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema" and "json_schema" not in fmt:
        if not isinstance(fmt.get("schema"), dict):
            raise APIError(400, 'text.format of type json_schema needs "schema": a JSON schema object',
                           param="text")
        return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    return fmt


def _input_messages(items: str | list[Any]) -> list[dict[str, Any]]:
    """`input` as chat messages: a string is one user message; items are messages (their content parts as the
    chat's: input_text / output_text -> text, input_image -> image_url), function_call (an assistant's tool call)
    and function_call_output (a tool message). Reasoning items are the model's past thinking: not sent again."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        where = f"input[{i}]"
        if kind == "message":
            messages.append({"role": item.get("role"), "content": _content(item.get("content"), where)})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # a turn's text and calls are one message
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str) else _content(output, where)})
        elif kind == "reasoning":
            continue
        else:
            raise APIError(400, f"not supported yet: {where} of type {kind!r} (message, function_call, "
                                "function_call_output, reasoning)", param="input")
    if not messages:
        raise APIError(400, "input holds no message", param="input")
    return messages


def _content(content: Any, where: str) -> Any:
    if isinstance(content, str) or content is None:
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}.content must be a string or a list of parts", param="input")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS:
            parts.append({"type": "text", "text": part.get("text", part.get("refusal", ""))})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            raise APIError(400, f"not supported yet: {where}.content[{j}] of type {kind!r} (input_text, "
                                "output_text, input_image with an image_url)", param="input")
    return parts


def _item_id(prefix: str, base: str, index: int) -> str:
    return f"{prefix}_{base}_{index}"


def _part(kind: str, text: str) -> dict[str, Any]:
    if kind == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(base: str, index: int, text: str) -> dict[str, Any]:
    return {"type": "message", "id": _item_id("msg", base, index), "role": "assistant", "status": "completed",
            "content": [_part("message", text)]}


def _reasoning_item(base: str, index: int, text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": _item_id("rs", base, index), "summary": [], "status": "completed",
            "content": [_part("reasoning", text)]}


def _call_item(base: str, index: int, call: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function_call", "id": _item_id("fc", base, index), "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": "completed"}


def _output_items(content: str, final: dict[str, Any], fmt: ReasoningFormat | None, base: str) -> list[dict]:
    """A whole reply's output items: its reasoning (when split), its text, its tool calls."""
    reasoning, answer = split_reasoning(content, fmt) if fmt is not None else ("", content)
    calls = final.get("tool_calls") or []
    items = [_reasoning_item(base, 0, reasoning)] if reasoning else []
    if answer.strip() or not calls:
        items.append(_message_item(base, len(items), answer))
    items += [_call_item(base, len(items) + k, c) for k, c in enumerate(calls)]
    return items


def _response_object(req: ResponsesRequest, job: _ChatJob, output: list[dict], final: dict | None) -> dict:
    """The Response object: in progress (no final chunk yet), completed, or incomplete when max_output_tokens
    ended the reply."""
    final = final or {}
    meta: MetaInfo = final["meta_info"] if final else {}
    reason: FinishReason = meta.get("finish_reason") or {}
    cut = reason.get("type") == "length" and not final.get("tool_calls")
    usage = None
    if final:
        u = _usage([final], 1)
        cached = u["prompt_tokens_details"]["cached_tokens"]
        # the radix cache keeps the whole prompt: what it did not hold yet is written to it
        details = {"cached_tokens": cached, "cache_write_tokens": u["prompt_tokens"] - cached}
        usage = {"input_tokens": u["prompt_tokens"], "input_tokens_details": details,
                 "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": u["total_tokens"]}
    status = "in_progress" if not final else "incomplete" if cut else "completed"
    return {"id": job.meta["id"], "object": "response", "created_at": job.meta["created"], "status": status,
            "completed_at": int(time.time()) if status == "completed" else None, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": job.meta["model"],
            "output": output, "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": None, "reasoning": req.reasoning, "store": False,
            "temperature": req.temperature, "top_p": req.top_p,
            "text": {"format": (req.text or {}).get("format") or {"type": "text"}},
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto", "tools": req.tools or [],
            "truncation": req.truncation or "disabled", "usage": usage, "user": req.user,
            "metadata": req.metadata or {}}

