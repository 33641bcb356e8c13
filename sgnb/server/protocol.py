"""The wire protocol: errors as JSON, bodies in and out, the request schemas, request ids and samples, and
the pieces of OpenAI responses."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request
from starlette.responses import Response

from sgnb.engine.meta_info import FinishReason, MetaInfo
from sgnb.logprobs import chat_logprobs
from sgnb.sampling import OPENAI_NAMES, SAMPLING_DEFAULTS
from sgnb.tools import ToolPlan, ToolSpecError, history_tool_calls, tool_plan

if TYPE_CHECKING:
    pass


log = logging.getLogger("sgnb.server")

# SGLang frontends send these sampling names; they change nothing here (no spaces are inserted between
# special tokens when decoding), so they are dropped rather than rejected.
_IGNORED_SAMPLING_NAMES = ("spaces_between_special_tokens",)
_HEALTH_TIMEOUT_S = 20.0
_FLUSH_TIMEOUT_S = 30.0
_OFF_LOOP_BODY_BYTES = 256 << 10  # bodies at least this big are parsed on a worker thread, not the event loop
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # a JSON escape of a UTF-16 surrogate (paired or lone)



# ---- errors ----------------------------------------------------------------------------------------------
class APIError(Exception):
    """An error answered to the client as JSON; raised anywhere below a route handler."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type, param
        self.code: int | str = code or status  # OpenAI's string codes where it has one (model_not_found)

    def response(self) -> Response:
        return _json_response({"error": {"message": self.message, "type": self.type, "param": self.param,
                                          "code": self.code}}, self.status)


_ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
                500: "internal_server_error", 503: "service_unavailable"}


def _engine_error(e: BaseException) -> APIError:
    """Map what the engine raises for a request to an HTTP error."""
    from sgnb.engine.engine import EngineError

    if isinstance(e, NotImplementedError):
        return APIError(400, f"not supported yet: {e}")
    if isinstance(e, (TypeError, ValueError)):
        return APIError(400, str(e))
    if isinstance(e, EngineError):
        return APIError(503, str(e), "service_unavailable")
    log.exception("request failed", exc_info=e)
    return APIError(500, f"internal error: {type(e).__name__}: {e}", "internal_server_error")


# ---- JSON in and out ---------------------------------------------------------------------------------------
def _finite(obj: Any) -> Any:
    """Replace non-finite floats by None (as orjson does): strict JSON parsers reject Infinity and NaN."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _dumps(obj: Any) -> bytes:
    try:
        text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except ValueError:  # a -inf logprob somewhere: rare, so only then walk the object
        text = json.dumps(_finite(obj), ensure_ascii=False, separators=(",", ":"))
    return text.encode("utf-8")


def _json_response(obj: Any, status: int = 200) -> Response:
    return Response(_dumps(obj), status_code=status, media_type="application/json")


def _sse(obj: Any) -> bytes:
    return b"data: " + _dumps(obj) + b"\n\n"


_SSE_DONE = b"data: [DONE]\n\n"


async def _json_body(request: Request) -> dict[str, Any]:
    """The body as a JSON object. A big one is parsed on a worker thread (a multi-megabyte message would hold
    every other client's request meanwhile). A string anywhere in it that holds a lone UTF-16 surrogate (JSON's
    "\\ud800" with no pair) is a 400 naming where: no tokenizer, encoder or request id can take it."""
    raw = await request.body()
    if not raw.strip():
        raise APIError(400, "the request body is empty: send a JSON object")
    body = await asyncio.to_thread(_parse, raw) if len(raw) >= _OFF_LOOP_BODY_BYTES else _parse(raw)
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _parse(raw: bytes) -> Any:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"malformed JSON in the request body: {e}") from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None
    if _SURROGATE_ESCAPE.search(raw):
        where = _lone_surrogate(body, "")
        if where is not None:
            path, index = where
            raise APIError(400, f"{path or 'the body'}: a lone UTF-16 surrogate at character {index}: strings must "
                                "be valid Unicode (a surrogate escape like \\ud83d needs its pair)",
                           param=path.split(".", 1)[0].split("[", 1)[0] or None)
    return body


def _lone_surrogate(obj: Any, path: str) -> tuple[str, int] | None:
    """(the path of the first string (or key) holding a lone surrogate, the character's index), or None."""
    stack = [(obj, path)]
    while stack:
        value, where = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                return where, e.start
        elif isinstance(value, dict):
            for k, v in reversed(value.items()):
                name = str(k).encode("utf-8", "backslashreplace").decode()  # a bad key is named, not raised
                inner = f"{where}.{name}" if where else name
                stack.append((v, inner))
                stack.append((k, inner))
        elif isinstance(value, list):
            stack.extend((v, f"{where}[{i}]") for i, v in reversed(list(enumerate(value))))
    return None


def _validate(schema: type[BaseModel], body: dict[str, Any]) -> Any:
    try:
        return schema.model_validate(body)
    except ValidationError as e:
        raise APIError(400, _explain(e)) from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None


def _explain(e: ValidationError) -> str:
    """One readable line per problem: `unknown field 'x'` or `field.path: what is wrong`."""
    lines: list[str] = []
    for err in e.errors(include_url=False):
        loc = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            lines.append(f"unknown field {loc!r}")
        elif err["type"] == "missing":
            lines.append(f"missing required field {loc!r}")
        else:
            lines.append(f"{loc}: {err['msg']}")
    return "invalid request: " + "; ".join(dict.fromkeys(lines))


# ---- request schemas -----------------------------------------------------------------------------------------
class _Schema(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class GenerateRequest(_Schema):
    """SGLang's /generate body (GenerateReqInput), minus what this engine cannot do."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: str | list[str] | None = None
    image_data: Any = None  # see _Media
    video_data: Any = None
    # SGLang fields accepted for compatibility: only their neutral values are
    audio_data: Any = None
    modalities: Any = None
    lora_path: Any = None
    return_hidden_states: bool = False
    custom_logit_processor: Any = None
    log_metrics: bool = True


class StreamOptions(_Schema):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _OpenAISampling(_Schema):
    """Sampling fields shared by /v1/completions and /v1/chat/completions, OpenAI's and SGLang's extras."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # SGLang extensions (sampling_params names where they differ: min_tokens -> min_new_tokens)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    regex: str | None = None
    ebnf: str | None = None
    json_schema: str | dict[str, Any] | None = None
    rid: str | None = None
    # OpenAI's: text, json_object or json_schema, applied as constrained decoding (as SGLang's `json_schema`)
    response_format: dict[str, Any] | None = None

    def sampling_params(self, max_new_tokens: int) -> dict[str, Any]:
        """The engine's sampling_params of the fields that are set (each under its SamplingParams name), a
        response_format as the constraint it asks for."""
        if self.logit_bias:
            raise APIError(400, "not supported yet: logit_bias", param="logit_bias")
        values = {name: getattr(self, field) for field, name in _SAMPLING_NAMES.items()}
        constraint = _response_format(self.response_format or {})
        if constraint and any(v is not None for v in (self.regex, self.json_schema, self.ebnf)):
            raise APIError(400, "give response_format or one of regex, json_schema, ebnf, not both",
                           param="response_format")
        return {"max_new_tokens": max_new_tokens, **{k: v for k, v in values.items() if v is not None}, **constraint}


# the fields above that are sampling values -> their SamplingParams names (each route gives max_new_tokens from
# its own max_tokens fields); tests check that every SamplingParams field has one
_ENGINE_NAMES = {wire: name for name, wire in OPENAI_NAMES.items()}
_SAMPLING_NAMES = {field: _ENGINE_NAMES.get(field, field) for field in _OpenAISampling.model_fields
                    if _ENGINE_NAMES.get(field, field) in SAMPLING_DEFAULTS}


class CompletionRequest(_OpenAISampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatCompletionRequest(_OpenAISampling):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    # SGLang's (and vLLM's): variables for the chat template over the engine's chat_template_kwargs (e.g.
    # {"enable_thinking": false} for Qwen3), and whether a reasoning model's thinking is returned apart
    # (message.reasoning_content; with `sgnb serve --reasoning-parser`)
    chat_template_kwargs: dict[str, Any] | None = None
    separate_reasoning: bool = True
    # accepted and ignored
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    reasoning_effort: str | None = None
    modalities: list[str] | None = None


class ResponsesRequest(_Schema):
    """OpenAI's /v1/responses body (sgnb/server/responses_api.py turns it into a chat completion request)."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    # refused (this server stores nothing): previous_response_id, conversation, background
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    # SGLang's (and vLLM's) extras, as on the chat route
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    stop: str | list[str] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # accepted and ignored
    reasoning: dict[str, Any] | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    truncation: str | None = None
    include: list[str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    max_tool_calls: int | None = None
    stream_options: dict[str, Any] | None = None


class TokenizeRequest(_Schema):
    """SGLang's /tokenize (/v1/tokenize): a prompt (or a list of them), or chat messages rendered as a chat
    completion renders them (what its prompt_tokens count)."""

    model: str | None = None
    prompt: str | list[str] | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = True
    # SGLang's, which its own request model always sends: only their chat-completion values are
    continue_final_message: bool = False
    add_generation_prompt: bool | None = None
    reasoning_effort: str | None = None


class DetokenizeRequest(_Schema):
    """SGLang's /detokenize (/v1/detokenize): token ids (or a list of lists) -> text."""

    model: str | None = None
    tokens: list[int] | list[list[int]]
    skip_special_tokens: bool = True


class EmbeddingRequest(_Schema):
    """OpenAI's /v1/embeddings body (read so that a bad one is named before the model's refusal)."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: str | None = None
    dimensions: int | None = None
    user: str | None = None


class AbortRequest(_Schema):
    rid: str | None = None
    abort_all: bool = False


class ConcatAppendRequest(_Schema):
    """SGLang's /concate_and_append_request (its frontend's `join("concate_and_append")`)."""

    src_rids: list[str]
    dst_rid: str


# ---- in-flight request ids (for /abort_request) ------------------------------------------------------------------
class _Inflight:
    """Request ids a client may name in /abort_request -> the engine request ids they cover (n > 1 expands)."""

    def __init__(self) -> None:
        self._ids: dict[str, list[str]] = {}

    @contextlib.contextmanager
    def track(self, ids: dict[str, list[str]]) -> Iterator[None]:
        self._ids.update(ids)
        try:
            yield
        finally:
            for key in ids:
                self._ids.pop(key, None)

    def engine_ids(self, rid: str | None, abort_all: bool) -> list[str]:
        if abort_all:
            return [r for ids in self._ids.values() for r in ids]
        return self._ids.get(rid, [rid]) if rid else []


def _new_rid() -> str:
    return uuid.uuid4().hex[:12]


def _n_of(params: dict[str, Any], max_n: int) -> int:
    n = params.get("n", 1)
    if n is None:
        return 1
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise APIError(400, f"sampling_params.n={n!r}: must be an int >= 1", param="n")
    if n > max_n:
        raise APIError(400, f"n={n}: at most {max_n} samples per prompt on this server (--max-n)", param="n")
    return n


def _check_samples(count: int, max_samples: int) -> None:
    """A request's engine requests (prompts x n) within the server's cap, before any is made."""
    if count > max_samples:
        raise APIError(400, f"this request asks for {count} samples (prompts x n): at most {max_samples} per request "
                            "on this server (--max-samples)", param="n")


# ---- OpenAI request and response pieces ------------------------------------------------------------------------
def _response_format(fmt: dict[str, Any]) -> dict[str, Any]:
    """response_format -> sampling params (json_object and json_schema become a JSON-schema constraint)."""
    kind = fmt.get("type", "text")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_schema": '{"type": "object"}'}
    spec = fmt.get("json_schema")
    if kind == "json_schema" and isinstance(spec, dict) and isinstance(spec.get("schema", {}), dict):
        return {"json_schema": json.dumps(spec.get("schema", {}))}
    if kind in ("structural_tag", "regex"):
        raise APIError(400, f"not supported yet: response_format of type {kind!r} (for a regex send SGLang's "
                            '"regex" field)', param="response_format")
    raise APIError(400, "response_format must be {type: text}, {type: json_object} or "
                        "{type: json_schema, json_schema: {schema: {...}}}", param="response_format")


def _batch_kw(prompts: list[Any]) -> dict[str, Any]:
    if all(isinstance(p, str) for p in prompts):
        return {"prompt": prompts}
    if all(isinstance(p, list) for p in prompts):
        return {"input_ids": prompts}
    raise APIError(400, "prompt: mix of text and token ids", param="prompt")


def _raise_failed(outs: list[dict]) -> None:
    """A request the engine failed on (finish_reason abort with an error) is a 500 for OpenAI clients."""
    for out in outs:
        meta: MetaInfo = out["meta_info"]
        error = meta.get("error")
        if error:
            raise APIError(500, f"generation failed: {error}", "internal_server_error")


def _finish(out: dict) -> dict[str, Any]:
    meta: MetaInfo = out["meta_info"]
    reason: FinishReason = meta["finish_reason"] or {}
    kind = reason.get("type")
    return {"finish_reason": kind, "matched_stop": reason.get("matched") if kind == "stop" else None}


def _usage(outs: list[dict], n: int) -> dict[str, Any]:
    """Prompt tokens count once per prompt (the n samples of a prompt share it); completions add up."""
    metas: list[MetaInfo] = [o["meta_info"] for o in outs if o]
    firsts = [m for k, m in enumerate(metas) if k % n == 0]
    prompt = sum(m["prompt_tokens"] for m in firsts)
    completion = sum(m["completion_tokens"] for m in metas)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(m["cached_tokens"] for m in firsts)}}


def _completion_logprobs(out: dict, echo: bool) -> dict[str, Any]:
    """The legacy completions format: tokens, token_logprobs, top_logprobs (token -> logprob), text_offset.
    With echo the prompt's tokens come first (the first has no logprob)."""
    meta: MetaInfo = out["meta_info"]
    inputs = list(meta.get("input_token_logprobs") or []) if echo else []
    outputs = list(meta.get("output_token_logprobs") or [])
    tops = ((list(meta.get("input_top_logprobs") or [None] * len(inputs)) if echo else [])
            + list(meta.get("output_top_logprobs") or [None] * len(outputs)))
    entries = inputs + outputs
    offset, tokens, offsets = 0, [], []
    for _, _, text in entries:
        tokens.append(text or "")
        offsets.append(offset)
        offset += len(text or "")
    return {"tokens": tokens, "token_logprobs": [lp for lp, _, _ in entries],
            "top_logprobs": [None if t is None else {text or "": lp for lp, _, text in t} for t in tops],
            "text_offset": offsets}


def _chat_logprobs(out: dict) -> dict[str, Any]:
    return chat_logprobs(out["meta_info"])


# ---- tool calling (/v1/chat/completions tools and tool_choice; the machinery is sgnb.tools') ------------------
def _tool_plan(tools: list[Any] | None, tool_choice: Any) -> ToolPlan | None:
    """sgnb.tools.tool_plan, a bad spec answered as a 400 naming the field."""
    try:
        return tool_plan(tools, tool_choice)
    except ToolSpecError as e:
        raise APIError(400, str(e), param=e.param) from None


def _history_tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """sgnb.tools.history_tool_calls, a bad history answered as a 400."""
    try:
        return history_tool_calls(calls, where)
    except ToolSpecError as e:
        raise APIError(400, str(e), param=e.param) from None
