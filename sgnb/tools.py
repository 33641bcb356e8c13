"""Tool calls: what `sgnb serve`'s /v1/chat/completions and the language's `gen(tools=...)` share.

The tool-call format is sgnb's, which is also Hermes' and Qwen's:
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`. A model whose chat template renders no tools is
told to use it (`tools_prompt`, in the system message); a reply that opens with it, or with a bare call object
(Llama 3.1 style), switches to a call constrained by the tools' JSON schemas (xgrammar), so the call always parses
and its arguments validate against the function's schema.

Contracts:
- `tool_plan(tools, tool_choice)` validates OpenAI's shapes and returns the plan (None when no call can be made);
  a bad spec raises ToolSpecError (a ValueError) naming the field, which the server answers as a 400 and gen()
  raises at its line.
- "required" (or a named function): the reply is TOOL_CALL_OPEN + "\\n", then one call object decoded under
  `call_schema`. "auto": text decoded with `text_params` (it stops where a call opens), then, when
  `opened_call` says one opened, the call decoded as for "required".
- `parse_call` turns a constrained call's text into OpenAI's `tool_calls` entry, or None when max_tokens cut it.
- `sgnb.tool_decode` runs these steps (one implementation for both).

No torch: `import sgnb` imports this (the grammar check imports the engine's grammar module only when called).
"""

from __future__ import annotations

import copy
import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sgnb.engine.meta_info import MetaInfo

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
TOOL_RESPONSE_OPEN = "<tool_response>"
TOOL_RESPONSE_CLOSE = "</tool_response>"
BARE_CALL_START = r'\A\s*\{\s*"name"\s*:'
_TOOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
# sampling values that do not apply to a constrained call (a stop string would cut its JSON short)
_NOT_FOR_CALLS = ("stop", "stop_regex", "stop_token_ids", "ignore_eos", "min_new_tokens", "no_stop_trim",
                  "regex", "ebnf", "json_schema")


class ToolSpecError(ValueError):
    """A bad tools / tool_choice (or tool-call history); `param` names the request field it is about."""

    def __init__(self, message: str, param: str = "tools") -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolPlan:
    """A request's tools and what tool_choice allows: mode "auto" (text or a call) or "required" (a call, to one
    of `allowed`; a named tool_choice allows one). `call_schema` constrains the call object; `choice` is the
    tool_choice as given (what a chat API is sent)."""

    mode: str
    tools: list[dict[str, Any]]
    functions: dict[str, dict[str, Any]]
    allowed: tuple[str, ...]
    call_schema: str
    choice: Any = "auto"

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


def tool_plan(tools: list[Any] | None, tool_choice: Any) -> ToolPlan | None:
    """Validate tools / tool_choice (OpenAI's shapes); None when no call can be made (no tools, or "none")."""
    if tools is None:
        if tool_choice not in (None, "none"):
            raise ToolSpecError("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, (list, tuple)):
        raise ToolSpecError(f"tools must be a list of tools, got {type(tools).__name__}")
    if not tools:
        raise ToolSpecError("tools is an empty list: give at least one tool, or leave tools out")
    functions: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise ToolSpecError(f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., '
                                '"description": ..., "parameters": {...}}}}')
        name = fn.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
            raise ToolSpecError(f"tools[{i}].function.name must be 1 to 64 letters, digits, _ . or -, got {name!r}")
        if name in functions:
            raise ToolSpecError(f"tools: two functions are named {name!r}")
        params = fn.get("parameters", _NO_PARAMETERS)
        if not isinstance(params, dict):
            raise ToolSpecError(f"tools[{i}].function.parameters must be a JSON schema object")
        if not isinstance(fn.get("description") or "", str):
            raise ToolSpecError(f"tools[{i}].function.description must be a string")
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
            raise ToolSpecError('tool_choice must be "none", "auto", "required" or {"type": "function", '
                                '"function": {"name": ...}}', "tool_choice")
        if name not in functions:
            raise ToolSpecError(f"tool_choice names the function {name!r}, which is not in tools", "tool_choice")
        mode, allowed = "required", (name,)
    try:
        schema = json.dumps(call_schema(functions, allowed))
    except RecursionError:
        raise ToolSpecError("tools: a function's parameters are nested too deeply") from None
    from sgnb.engine.grammar import validate_constraint

    try:
        validate_constraint("json_schema", schema)
    except ValueError as e:
        raise ToolSpecError(f"tools: a function's parameters are not a usable JSON schema: {e}") from None
    return ToolPlan(mode, list(tools), functions, allowed, schema, choice)


def call_schema(functions: dict[str, dict[str, Any]], allowed: tuple[str, ...]) -> dict[str, Any]:
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


def tool_call(name: str, arguments: Any) -> dict[str, Any]:
    """One entry of OpenAI's message.tool_calls (arguments as a JSON string)."""
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def parse_call(text: str, plan: ToolPlan) -> dict[str, Any] | None:
    """The tool call a constrained call's text holds, or None (cut short by max_tokens)."""
    try:
        obj = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(obj, dict) or obj.get("name") not in plan.allowed or "arguments" not in obj:
        return None
    return tool_call(obj["name"], obj["arguments"])


def opened_call(finish_reason: Any) -> str | None:
    """How an "auto" reply (decoded with `text_params`) ended: "tagged" where it stopped at TOOL_CALL_OPEN,
    "bare" at a bare call object ({"name": ...), None when it is text."""
    reason = finish_reason if isinstance(finish_reason, dict) else {}
    matched = reason.get("matched") if reason.get("type") == "stop" else None
    if matched == TOOL_CALL_OPEN:
        return "tagged"
    if isinstance(matched, str) and re.match(BARE_CALL_START, matched) is not None:
        return "bare"
    return None


def joined_meta(text: MetaInfo, call: MetaInfo) -> MetaInfo:
    """meta_info of a reply decoded in two requests (text, then the constrained call after it)."""
    out: MetaInfo = {**call, "prompt_tokens": text.get("prompt_tokens", 0), "cached_tokens": text.get("cached_tokens", 0),
                     "completion_tokens": text.get("completion_tokens", 0) + call.get("completion_tokens", 0)}
    if text.get("output_token_logprobs") is not None or call.get("output_token_logprobs") is not None:
        out["output_token_logprobs"] = [*(text.get("output_token_logprobs") or []),
                                        *(call.get("output_token_logprobs") or [])]
    if text.get("output_top_logprobs") is not None or call.get("output_top_logprobs") is not None:
        out["output_top_logprobs"] = [*(text.get("output_top_logprobs") or []), *(call.get("output_top_logprobs") or [])]
    return out


def tools_prompt(functions: dict[str, dict[str, Any]]) -> str:
    """What a model whose chat template renders no tools is told about them (in the system message)."""
    listed = "\n".join(json.dumps({"type": "function", "function": f}, ensure_ascii=False) for f in functions.values())
    return ("You can call functions to help with the user's request. Their JSON schemas:\n<tools>\n" + listed
            + "\n</tools>\nTo call a function, reply with nothing but\n" + TOOL_CALL_OPEN
            + '\n{"name": "<function name>", "arguments": {<the arguments as JSON>}}\n' + TOOL_CALL_CLOSE)


def history_tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's tool_calls (OpenAI's shape) -> [{"id", "name", "arguments"}], arguments parsed
    from their JSON string (kept as the string when it is not JSON)."""
    if not isinstance(calls, list):
        raise ToolSpecError(f"{where}.tool_calls must be a list", "messages")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ToolSpecError(f'{where}.tool_calls[{j}] must be {{"id": ..., "type": "function", "function": '
                                '{"name": ..., "arguments": "<JSON>"}}', "messages")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except (json.JSONDecodeError, RecursionError):
                pass
        call_id = call.get("id")
        out.append({"id": call_id if isinstance(call_id, str) else None, "name": fn["name"], "arguments": args})
    return out


def call_text(name: str, arguments: Any) -> str:
    """A call in sgnb's format (a past call for templates that render no tool calls; a chat API's call in a
    program's text)."""
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"


def tool_response_text(content: str) -> str:
    """A tool result as a user message's content, for templates that render no "tool" role."""
    return f"{TOOL_RESPONSE_OPEN}\n{content}\n{TOOL_RESPONSE_CLOSE}"


_PROBE = "sgnb_probe_3f9c1"


def tool_support(render: Callable[..., str]) -> tuple[bool, bool]:
    """(whether a chat template renders tools, whether it renders a "tool" role message), by rendering probes
    with `render(messages, add_generation_prompt, **variables)`: a template that ignores `tools` (or fails on
    them) gets sgnb's fallback."""
    probe = {"type": "function", "function": {"name": _PROBE, "description": "probe",
                                              "parameters": {"type": "object", "properties": {}}}}
    try:
        native = _PROBE in render([{"role": "user", "content": "hi"}], True, tools=[probe])
    except Exception:
        native = False
    try:
        tool_role = _PROBE in render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"},
                                      {"role": "tool", "content": _PROBE}], True)
    except Exception:
        tool_role = False
    return native, tool_role
