"""The primitives a program appends: gen, select, roles, image, video, separate_reasoning.

Each returns IR nodes; values are checked here, at the user's line, before anything runs.
"""

from __future__ import annotations

import json
import re
from typing import Any

from sgnb import ir
from sgnb.engine.scoring import SCORING_METHODS
from sgnb.media import DEFAULT_NUM_FRAMES, check_image, check_video
from sgnb.sampling import GEN_NAMES, GenParams
from sgnb.tools import ToolPlan, ToolSpecError, tool_plan
from sgnb.user_code import user_location

_DTYPES = (int, float, str, bool)
_DTYPE_NAMES = {t.__name__: t for t in _DTYPES}


def gen(name: str | None = None, max_tokens: int | None = None, min_tokens: int | None = None,
        n: int | None = None, stop: str | list[str] | None = None, stop_token_ids: list[int] | None = None,
        stop_regex: str | list[str] | None = None, temperature: float | None = None, top_p: float | None = None,
        top_k: int | None = None, min_p: float | None = None, frequency_penalty: float | None = None,
        presence_penalty: float | None = None, ignore_eos: bool | None = None, return_logprob: bool | None = None,
        logprob_start_len: int | None = None, top_logprobs_num: int | None = None,
        return_text_in_logprobs: bool | None = None, dtype: type | None = None,
        choices: list[str] | None = None, choices_method: str | None = None, regex: str | None = None,
        json_schema: Any = None, grammar: str | None = None, repetition_penalty: float | None = None,
        tools: list[dict[str, Any]] | None = None, tool_choice: Any = None) -> ir.Node:
    """Generate text into variable `name`. Unset parameters inherit the program's run() defaults.
    `choices=[...]` makes it a select; `dtype=int|float|str|bool` constrains and converts the value.

    `n=k` (k > 1) draws k samples of one request: the variable holds the k texts (a list, each converted by
    `dtype`), the program's text goes on with the first, and get_meta_info(name) is the first's with "samples"
    (every sample's meta_info), as SGLang's frontend keeps them.

    `tools=[...]` (OpenAI's tool shapes) lets the reply be a tool call, as tool_choice says: "auto" (the
    default: text, or a call once the model opens one), "required" (a call to one of them) or
    {"type": "function", "function": {"name": ...}} (a call to that one); a call is decoded under its function's
    JSON schema. The calls are get_meta_info(name)["tool_calls"] (OpenAI's shape; also `s.tool_calls(name)`);
    the variable and the text hold the reply as the model wrote it (<tool_call>...</tool_call>; with
    run(stream=True) it arrives in one piece). Describe the tools to the model with system(..., tools=[...])
    and answer a call with tool(result)."""
    keywords = dict(locals())  # gen()'s arguments: from_keywords reads GenParams' fields (as GEN_NAMES spells them)
    where = user_location()
    plan = _tool_plan_at("gen", tools, tool_choice)
    if choices is not None:
        if plan is not None:
            raise ValueError("gen(choices=...) is a select: it cannot call tools")
        return select(name, choices, temperature or 0.0, choices_method or token_length_normalized)
    if isinstance(dtype, str) and dtype in _DTYPE_NAMES:  # SGLang takes the types' names too
        dtype = _DTYPE_NAMES[dtype]
    if dtype is not None and dtype not in _DTYPES:
        raise ValueError(f"gen(dtype=...) takes one of int, float, str, bool (or their names); got {dtype!r}")
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        raise ValueError(f"gen(n=...) must be an int >= 1, got {n!r}")
    params = GenParams.from_keywords({**keywords, "n": None if n == 1 else n}, GEN_NAMES)  # n=1: the default
    if dtype is not None and (params.regex or params.json_schema or params.ebnf):
        raise ValueError("gen(dtype=...) cannot be combined with regex / json_schema / grammar")
    if plan is not None and (dtype is not None or params.regex or params.json_schema or params.ebnf):
        raise ValueError("gen(tools=...) cannot be combined with dtype / regex / json_schema / grammar: the call "
                         "is constrained by the tools' schemas")
    if plan is not None and params.n is not None:
        raise ValueError("gen(tools=...) takes one sample (n=1): fork the program for several")
    return ir.Gen(name, params, dtype, plan, where=where)


def _tool_plan_at(call: str, tools: Any, tool_choice: Any) -> ToolPlan | None:
    """tool_plan, a bad spec raised as a ValueError naming the primitive's argument (at the user's line)."""
    try:
        return tool_plan(tools, tool_choice)
    except ToolSpecError as e:
        raise ValueError(f"{call}({e.param}=...): {e}") from None


# SGLang's ready-made patterns for gen(regex=...), with SGLang's values (sglang.lang.ir), so programs using them
# constrain exactly as they do there
REGEX_INT = r"[-+]?[0-9]+[ \n]*"
REGEX_FLOAT = r"[-+]?[0-9]*\.?[0-9]+[ \n]*"
REGEX_BOOL = r"(True|False)"
REGEX_STR = r"\"[\w\d\s]*\""


# SGLang's choices methods, by the names select(choices_method=...) takes: sgl.select(..., choices_method=
# sgl.unconditional_likelihood_normalized) reads as in SGLang
token_length_normalized = "token_length_normalized"
greedy_token_selection = "greedy_token_selection"
unconditional_likelihood_normalized = "unconditional_likelihood_normalized"


def _method_name(method: Any) -> str:
    """A choices method by its name, or SGLang's object for it (`sglang.lang.choices.token_length_normalized`,
    an instance of TokenLengthNormalized, ...): its class name in snake case. ValueError for anything else."""
    if isinstance(method, str):
        name = method
    else:
        name = re.sub(r"(?<!^)(?=[A-Z])", "_", type(method).__name__).lower()
        if name not in SCORING_METHODS:
            raise ValueError(f"choices_method {type(method).__name__} is not one of SGLang's three methods, which "
                             f"are what the backends score with: {SCORING_METHODS}")
    if name not in SCORING_METHODS:
        raise ValueError(f"choices_method must be one of {SCORING_METHODS}, got {method!r}")
    return name


def gen_int(name: str | None = None, **kwargs: Any) -> ir.Node:
    return gen(name, dtype=int, **kwargs)


def gen_string(name: str | None = None, **kwargs: Any) -> ir.Node:
    return gen(name, dtype=str, **kwargs)


def select(name: str | None = None, choices: list[str] | None = None, temperature: float = 0.0,
           choices_method: Any = "token_length_normalized") -> ir.Node:
    """Choose one of `choices` by the model's likelihood of each continuation: the best-scored one, or with
    `temperature` > 0 one drawn with probabilities softmax(score / temperature) over the method's per-choice
    scores (the normalized logprobs; for unconditional_likelihood_normalized, those less the unconditional
    ones). greedy_token_selection ranks token by token and has no such score: it takes no temperature."""
    where = user_location()
    if not choices or not all(isinstance(c, str) for c in choices):
        raise ValueError("select(choices=...) needs a non-empty list of strings")
    if len(set(choices)) != len(choices):
        raise ValueError("select choices must be distinct")
    choices_method = _method_name(choices_method)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0:
        raise ValueError(f"select temperature must be a number >= 0, got {temperature!r}")
    if temperature > 0 and choices_method == "greedy_token_selection":
        raise ValueError("select(temperature > 0) draws from the choices' scores; greedy_token_selection ranks "
                         "token by token and has none: use token_length_normalized to sample")
    return ir.Select(name, tuple(choices), float(temperature), choices_method, where=where)


def as_node(value: Any) -> ir.Node:
    """What `s += value` appends: a node as it is; a str (an int, a float) as text, at the user's line."""
    if isinstance(value, ir.Node):
        return value
    if isinstance(value, str):
        return ir.Text(value, where=user_location())
    if isinstance(value, (int, float)):
        return ir.Text(str(value), where=user_location())
    raise TypeError(f"cannot append a {type(value).__name__} to a program: use a str or an sgnb primitive")


def role(name: str, content: Any = None, tools: list[dict[str, Any]] | None = None,
         tool_call_id: str | None = None) -> ir.Node:
    """A message of role `name` with `content` (a str or primitives; None: an empty message). The one place a
    message is built: sgl.user(...), s.user(...) and a traced program's roles all come here (`with s.user():`
    appends the begin and end nodes around the block instead). `tools` (a system message): their descriptions
    follow the content; `tool_call_id` (a tool message): the call it answers."""
    where = user_location()
    items: tuple[ir.Node, ...] = (ir.RoleBegin(name, tool_call_id),)
    if content is not None:
        items += (as_node(content),)
    if tools is not None:
        plan = _tool_plan_at(name, tools, "auto")
        if plan is None:
            raise ValueError("system(tools=...) needs at least one tool")
        items += (ir.Tools(plan),)
    return ir.Sequence(items + (ir.RoleEnd(name),), where=where)


def system(content: Any = None, tools: list[dict[str, Any]] | None = None) -> ir.Node:
    """A system message; `tools=[...]` (OpenAI's tool shapes) describes them to the model after the content, as
    its chat template does (else in sgnb's tool prompt, as `sgnb serve` does), for gen(tools=...) later. The
    descriptions are in the text, not in the message's content (what a chat API is sent with the gen's tools)."""
    return role("system", content, tools)


def tool(content: Any = None, tool_call_id: str | None = None) -> ir.Node:
    """A tool's result, in a "tool" message (rendered as the chat template renders that role, else as a user
    message holding <tool_response>...</tool_response>). A dict or list is sent as JSON. `tool_call_id`: the
    call it answers (default: the next unanswered call of the last assistant message)."""
    if isinstance(content, (dict, list)):
        content = json.dumps(content, ensure_ascii=False)
    return role("tool", content, tool_call_id=tool_call_id)


def user(content: Any = None) -> ir.Node:
    return role("user", content)


def assistant(content: Any = None) -> ir.Node:
    return role("assistant", content)


def system_begin() -> ir.Node:
    return ir.RoleBegin("system", where=user_location())


def system_end() -> ir.Node:
    return ir.RoleEnd("system", where=user_location())


def user_begin() -> ir.Node:
    return ir.RoleBegin("user", where=user_location())


def user_end() -> ir.Node:
    return ir.RoleEnd("user", where=user_location())


def assistant_begin() -> ir.Node:
    return ir.RoleBegin("assistant", where=user_location())


def assistant_end() -> ir.Node:
    return ir.RoleEnd("assistant", where=user_location())


def image(path: Any) -> ir.Node:
    """An image at this point of the program: the backend's image token goes into the text here (inside the
    role it is added to) and the image travels with every later gen/select of this state and its forks.
    `path`: a file path, a PIL image, a uint8 array (H, W, 3), encoded bytes, a data: URL, or an http(s) URL (for
    servers that fetch; never fetched here). The file is read when the program runs: a missing or unreadable
    image, or a backend that takes no images, fails at this line."""
    where = user_location()
    check_image(path)
    return ir.Image(path, where=where)


def video(path: Any, num_frames: int = DEFAULT_NUM_FRAMES) -> ir.Node:
    """A video (its file path) sampled to `num_frames` frames, placed like image()."""
    where = user_location()
    check_video(path, num_frames)
    return ir.Video(path, num_frames, where=where)


def separate_reasoning(expr: ir.Node | None = None, model_type: str | None = None) -> ir.Node:
    """Split the reasoning off every named gen and select in `expr` (a gen, a role such as
    `assistant(gen(...))`, or any expression): each variable keeps the answer, `NAME_reasoning_content` the
    reasoning ("" when there was none), and the reasoning leaves the program's text and messages, as the
    models' chat templates expect of a conversation that goes on. `model_type` is an SGLang reasoning-parser
    name (`qwen3`, `deepseek-r1`, `gpt-oss`, `mistral`, ...: sgnb/reasoning.py); None: the backend's
    `reasoning_parser` if it has one, else `<think>` blocks, the reply starting inside one when it closes a
    block it did not open."""
    from .reasoning import reasoning_format

    where = user_location()
    if model_type is not None:
        reasoning_format(model_type)  # an unknown name fails here, at the user's line
    if expr is None:
        return ir.Sequence((), where=where)
    if not isinstance(expr, ir.Node):
        raise TypeError(f"separate_reasoning wraps a program expression (gen(...), assistant(...)), "
                        f"not {type(expr).__name__}")
    names = tuple(_gen_names(expr))
    return ir.Sequence((expr, ir.SeparateReasoning(names, model_type)), where=where)


def _gen_names(node: ir.Node) -> list[str]:
    if isinstance(node, ir.Sequence):
        return [n for item in node.items for n in _gen_names(item)]
    if isinstance(node, (ir.Gen, ir.Select)) and node.name is not None:
        return [node.name]
    return []
