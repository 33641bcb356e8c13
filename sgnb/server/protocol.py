"""The wire protocol: errors as JSON, bodies in and out, the request schemas, request ids and samples, and
the pieces of OpenAI responses."""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request
from starlette.responses import Response

from sgnb.sampling import OPENAI_NAMES, SAMPLING_DEFAULTS

if TYPE_CHECKING:
    pass


log = logging.getLogger("sgnb.server")

# SGLang frontends send these sampling names; they change nothing here (no spaces are inserted between
# special tokens when decoding), so they are dropped rather than rejected.
_IGNORED_SAMPLING_NAMES = ("spaces_between_special_tokens",)
_HEALTH_TIMEOUT_S = 20.0
_FLUSH_TIMEOUT_S = 30.0



# ---- errors ----------------------------------------------------------------------------------------------
class APIError(Exception):
    """An error answered to the client as JSON; raised anywhere below a route handler."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type, param

    def response(self) -> Response:
        return _json_response({"error": {"message": self.message, "type": self.type, "param": self.param,
                                          "code": self.status}}, self.status)


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
    raw = await request.body()
    if not raw.strip():
        raise APIError(400, "the request body is empty: send a JSON object")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"malformed JSON in the request body: {e}") from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


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

    def sampling_params(self, max_new_tokens: int) -> dict[str, Any]:
        """The engine's sampling_params of the fields that are set (each under its SamplingParams name)."""
        if self.logit_bias:
            raise APIError(400, "not supported yet: logit_bias", param="logit_bias")
        values = {name: getattr(self, field) for field, name in _SAMPLING_NAMES.items()}
        return {"max_new_tokens": max_new_tokens, **{k: v for k, v in values.items() if v is not None}}


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
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    # accepted and ignored
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    reasoning_effort: str | None = None
    modalities: list[str] | None = None


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
        error = out["meta_info"].get("error")
        if error:
            raise APIError(500, f"generation failed: {error}", "internal_server_error")


def _finish(out: dict) -> dict[str, Any]:
    reason = out["meta_info"]["finish_reason"] or {}
    kind = reason.get("type")
    return {"finish_reason": kind, "matched_stop": reason.get("matched") if kind == "stop" else None}


def _usage(outs: list[dict], n: int) -> dict[str, Any]:
    """Prompt tokens count once per prompt (the n samples of a prompt share it); completions add up."""
    metas = [o["meta_info"] for o in outs if o]
    firsts = [m for k, m in enumerate(metas) if k % n == 0]
    prompt = sum(m["prompt_tokens"] for m in firsts)
    completion = sum(m["completion_tokens"] for m in metas)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(m["cached_tokens"] for m in firsts)}}


def _completion_logprobs(out: dict, echo: bool) -> dict[str, Any]:
    """The legacy completions format: tokens, token_logprobs, top_logprobs (token -> logprob), text_offset.
    With echo the prompt's tokens come first (the first has no logprob)."""
    meta = out["meta_info"]
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
    meta = out["meta_info"]
    entries = meta.get("output_token_logprobs") or []
    tops = meta.get("output_top_logprobs") or [None] * len(entries)

    def item(lp: float, text: str | None) -> dict[str, Any]:
        text = text or ""
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(lp, text), "top_logprobs": [item(tlp, tt) for tlp, _, tt in (top or [])]}
                        for (lp, _, text), top in zip(entries, tops)]}


# ---- tool calling (/v1/chat/completions tools and tool_choice) -------------------------------------------------
# sgnb's tool-call format, which is also Hermes' and Qwen's: <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>.
# A model whose chat template renders no tools is told to use it (the tool prompt below); a reply that opens with
# it, or with a bare call object (Llama 3.1 style), switches to a call constrained by the tools' schemas.
TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
BARE_CALL_START = r'\A\s*\{\s*"name"\s*:'
_TOOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
# sampling values that do not apply to a constrained call (a stop string would cut its JSON short)
_NOT_FOR_CALLS = ("stop", "stop_regex", "stop_token_ids", "ignore_eos", "min_new_tokens", "no_stop_trim",
                  "regex", "ebnf", "json_schema")


@dataclass(frozen=True)
class ToolPlan:
    """A request's tools and what tool_choice allows: mode "auto" (text or a call) or "required" (a call, to one
    of `allowed`; a named tool_choice allows one). `call_schema` constrains the call object."""

    mode: str
    tools: list[dict[str, Any]]
    functions: dict[str, dict[str, Any]]
    allowed: tuple[str, ...]
    call_schema: str

    def call_params(self, sp: dict[str, Any], max_new_tokens: int | None = None) -> dict[str, Any]:
        """Sampling params for the constrained call: the request's, minus stops, plus the call schema."""
        out = {k: v for k, v in sp.items() if k not in _NOT_FOR_CALLS}
        if max_new_tokens is not None:
            out["max_new_tokens"] = max(max_new_tokens, 1)
        return {**out, "json_schema": self.call_schema}

    def text_params(self, sp: dict[str, Any]) -> dict[str, Any]:
        """Sampling params for "auto" text: the request's, also stopping where a tool call opens."""
        stop = sp.get("stop") or []
        regex = sp.get("stop_regex") or []
        return {**sp, "stop": [*([stop] if isinstance(stop, str) else stop), TOOL_CALL_OPEN],
                "stop_regex": [*([regex] if isinstance(regex, str) else regex), BARE_CALL_START]}


def _tool_plan(tools: list[Any] | None, tool_choice: Any) -> ToolPlan | None:
    """Validate tools / tool_choice (OpenAI's shapes); None when no call can be made (no tools, or "none")."""
    if tools is None:
        if tool_choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return None
    if not tools:
        raise APIError(400, "tools is an empty list: give at least one tool, or leave tools out", param="tools")
    functions: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise APIError(400, f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., '
                                '"description": ..., "parameters": {...}}}}', param="tools")
        name = fn.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
            raise APIError(400, f"tools[{i}].function.name must be 1 to 64 letters, digits, _ . or -, got {name!r}",
                           param="tools")
        if name in functions:
            raise APIError(400, f"tools: two functions are named {name!r}", param="tools")
        params = fn.get("parameters", _NO_PARAMETERS)
        if not isinstance(params, dict):
            raise APIError(400, f"tools[{i}].function.parameters must be a JSON schema object", param="tools")
        if not isinstance(fn.get("description") or "", str):
            raise APIError(400, f"tools[{i}].function.description must be a string", param="tools")
        functions[name] = {"name": name, **({"description": fn["description"]} if fn.get("description") else {}),
                           "parameters": params}
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return None
    if choice in ("auto", "required"):
        mode, allowed = choice, tuple(functions)
    else:
        fn = choice.get("function") if isinstance(choice, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
            raise APIError(400, 'tool_choice must be "none", "auto", "required" or {"type": "function", '
                                '"function": {"name": ...}}', param="tool_choice")
        if name not in functions:
            raise APIError(400, f"tool_choice names the function {name!r}, which is not in tools", param="tool_choice")
        mode, allowed = "required", (name,)
    try:
        schema = json.dumps(_call_schema(functions, allowed))
    except RecursionError:
        raise APIError(400, "tools: a function's parameters are nested too deeply", param="tools") from None
    from sgnb.engine.grammar import validate_constraint

    try:
        validate_constraint("json_schema", schema)
    except ValueError as e:
        raise APIError(400, f"tools: a function's parameters are not a usable JSON schema: {e}", param="tools") from None
    return ToolPlan(mode, list(tools), functions, allowed, schema)


def _call_schema(functions: dict[str, dict[str, Any]], allowed: tuple[str, ...]) -> dict[str, Any]:
    """The JSON schema of one call object {"name": ..., "arguments": {...}} to any of `allowed`. Each function's
    own $defs move to the top (renamed per function), so its $refs still resolve."""
    defs: dict[str, Any] = {}
    alternatives = []
    for i, name in enumerate(allowed):
        params = _hoist_defs(copy.deepcopy(functions[name]["parameters"]), f"f{i}_", defs)
        alternatives.append({"type": "object", "properties": {"name": {"const": name}, "arguments": params},
                             "required": ["name", "arguments"], "additionalProperties": False})
    schema = alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives}
    return {**schema, "$defs": defs} if defs else schema


def _hoist_defs(params: dict[str, Any], prefix: str, defs: dict[str, Any]) -> dict[str, Any]:
    if not any(k in params for k in ("type", "anyOf", "oneOf", "allOf", "$ref", "enum", "const")):
        params = {**params, "type": "object"}  # OpenAI reads parameters as an object's schema
    local = {**params.pop("definitions", {}), **params.pop("$defs", {})}
    recursive = []

    def fix(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str):
                if ref == "#":
                    recursive.append(True)
                    node = {**node, "$ref": f"#/$defs/{prefix}root"}
                for old in ("#/$defs/", "#/definitions/"):
                    if ref.startswith(old):
                        node = {**node, "$ref": f"#/$defs/{prefix}{ref[len(old):]}"}
            return {k: fix(v) for k, v in node.items()}
        if isinstance(node, list):
            return [fix(v) for v in node]
        return node

    params = fix(params)
    for key, value in local.items():
        defs[prefix + key] = fix(value)
    if recursive:
        defs[prefix + "root"] = params
        return {"$ref": f"#/$defs/{prefix}root"}
    return params


def _tool_call(name: str, arguments: Any) -> dict[str, Any]:
    """One entry of OpenAI's message.tool_calls."""
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _parse_call(text: str, plan: ToolPlan) -> dict[str, Any] | None:
    """The tool call a constrained call's text holds, or None (cut short by max_tokens)."""
    try:
        obj = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(obj, dict) or obj.get("name") not in plan.allowed or "arguments" not in obj:
        return None
    return _tool_call(obj["name"], obj["arguments"])


def _tools_prompt(functions: dict[str, dict[str, Any]]) -> str:
    """What a model whose chat template renders no tools is told about them (in the system message)."""
    listed = "\n".join(json.dumps({"type": "function", "function": f}, ensure_ascii=False) for f in functions.values())
    return ("You can call functions to help with the user's request. Their JSON schemas:\n<tools>\n" + listed
            + "\n</tools>\nTo call a function, reply with nothing but\n" + TOOL_CALL_OPEN
            + '\n{"name": "<function name>", "arguments": {<the arguments as JSON>}}\n' + TOOL_CALL_CLOSE)


def _history_tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's tool_calls (OpenAI's shape) -> [{"id", "name", "arguments"}], arguments parsed
    from their JSON string (kept as the string when it is not JSON)."""
    if not isinstance(calls, list):
        raise APIError(400, f"{where}.tool_calls must be a list", param="messages")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise APIError(400, f'{where}.tool_calls[{j}] must be {{"id": ..., "type": "function", "function": '
                                '{"name": ..., "arguments": "<JSON>"}}', param="messages")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except (json.JSONDecodeError, RecursionError):
                pass
        call_id = call.get("id")
        out.append({"id": call_id if isinstance(call_id, str) else None, "name": fn["name"], "arguments": args})
    return out


def _call_text(call: dict[str, Any]) -> str:
    """A past call in sgnb's format (for templates that render no tool calls)."""
    body = json.dumps({"name": call["name"], "arguments": call["arguments"]}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"
