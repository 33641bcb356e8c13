"""The tool-call decode protocol (sgnb.tool_decode) without an engine: which requests a reply makes, with which
sampling values and after which text, and the reply they add up to (text, content, call, meta), for "required",
"required" after the reasoning, and "auto" (a text reply, a tagged call, a bare call, a call cut short). The
interpreter and the server run it over real models (test_tools_lang.py, tests/server/test_tools.py)."""

from __future__ import annotations

import json

from sgnb.tool_decode import CallStep, decode_tool_call, tool_steps
from sgnb.tools import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, tool_plan

ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
CALL = '{"name": "add", "arguments": {"a": 2, "b": 3}}'
SP = {"max_new_tokens": 50, "temperature": 0.0, "stop": ["\n\n"]}


def _meta(completion: int, matched: str | None = None) -> dict:
    reason = {"type": "stop", "matched": matched} if matched is not None else {"type": "length", "length": completion}
    return {"prompt_tokens": 10, "cached_tokens": 4, "completion_tokens": completion, "finish_reason": reason}


def _run(tool_choice, replies, sp=SP, after=None):
    """The reply, and the steps it asked for, when its requests decode `replies` in turn."""
    steps: list[CallStep] = []

    def generate(step: CallStep) -> tuple[str, dict]:
        steps.append(step)
        return replies[len(steps) - 1]

    return decode_tool_call(tool_plan([ADD], tool_choice), sp, generate, after), steps


def test_required_is_one_call_request_after_the_opening():
    reply, (step,) = _run("required", [(CALL, _meta(20))])
    assert step.prefix == TOOL_CALL_OPEN + "\n" and not step.streamed
    assert "stop" not in step.params and json.loads(step.params["json_schema"])["properties"]["name"]["const"] == "add"
    assert reply.text == f"{TOOL_CALL_OPEN}\n{CALL}\n{TOOL_CALL_CLOSE}" and reply.call_start == 0
    assert reply.content == "" and reply.call["function"]["name"] == "add"
    assert json.loads(reply.call["function"]["arguments"]) == {"a": 2, "b": 3}
    assert reply.meta == _meta(20)


def test_a_required_call_cut_short_is_its_raw_text():
    reply, _ = _run("required", [('{"name": "add", "argu', _meta(50))])
    assert reply.call is None and reply.content == '{"name": "add", "argu'  # the prompt's opening is not content
    assert reply.text == TOOL_CALL_OPEN + '\n{"name": "add", "argu' and reply.call_start == len(reply.text)


def test_required_after_the_reasoning_is_one_request():
    reply, (step,) = _run("required", [(f"<think>sum</think>\n {CALL}", _meta(30))], after="</think>")
    assert step.prefix == "" and step.params["grammar_after"] == "</think>" and "json_schema" in step.params
    assert reply.content == "<think>sum</think>" and reply.call_start == len(reply.content)
    assert reply.text == f"<think>sum</think>\n\n{TOOL_CALL_OPEN}\n{CALL}\n{TOOL_CALL_CLOSE}"
    assert reply.call["function"]["name"] == "add"
    unclosed, _ = _run("required", [("<think>still thinking", _meta(50))], after="</think>")
    assert unclosed.call is None and unclosed.text == unclosed.content == "<think>still thinking"


def test_auto_text_reply_is_one_streamed_request():
    reply, (step,) = _run("auto", [("It is sunny.", _meta(5, "\n\n"))])
    assert step.streamed and step.prefix == ""
    assert step.params["stop"] == ["\n\n", TOOL_CALL_OPEN] and step.params["stop_regex"]  # stops where a call opens
    assert reply.call is None and reply.text == reply.content == "It is sunny." and reply.meta == _meta(5, "\n\n")


def test_auto_tagged_call_continues_after_the_text_within_the_budget():
    reply, (text, call) = _run("auto", [("Let me add. ", _meta(4, TOOL_CALL_OPEN)), (CALL, _meta(20))])
    assert call.prefix == "Let me add. " + TOOL_CALL_OPEN + "\n" and not call.streamed
    assert call.params["max_new_tokens"] == 50 - 4 and "stop" not in call.params
    assert reply.content == "Let me add. " and reply.call_start == len("Let me add. ")
    assert reply.text == f"Let me add. {TOOL_CALL_OPEN}\n{CALL}\n{TOOL_CALL_CLOSE}"
    assert reply.meta["prompt_tokens"] == 10 and reply.meta["completion_tokens"] == 24  # both requests counted
    assert reply.meta["finish_reason"] == _meta(20)["finish_reason"]


def test_auto_bare_call_is_decoded_from_its_start():
    # no_stop_trim: the text still ends with what matched, which the call request decodes again
    sp = {**SP, "no_stop_trim": True}
    reply, (_, call) = _run("auto", [('{"name":', _meta(3, '{"name":')), (CALL, _meta(20))], sp=sp)
    assert call.prefix == "" and "no_stop_trim" not in call.params
    assert reply.text == CALL and reply.content == "" and reply.call_start == 0  # the model's own format, no tags


def test_an_auto_call_cut_short_is_content():
    reply, _ = _run("auto", [("Hm. ", _meta(4, TOOL_CALL_OPEN)), ('{"na', _meta(46))])
    assert reply.call is None and reply.content == reply.text == f"Hm. {TOOL_CALL_OPEN}\n" + '{"na'


def test_the_steps_are_a_generator_a_caller_drives():
    """The server drives tool_steps itself (async): it is sent each request's (text, meta_info)."""
    steps = tool_steps(tool_plan([ADD], "auto"), SP)
    assert next(steps).streamed
    call = steps.send(("", _meta(1, TOOL_CALL_OPEN)))
    assert call.prefix == TOOL_CALL_OPEN + "\n"
    try:
        steps.send((CALL, _meta(20)))
    except StopIteration as done:
        assert done.value.call["function"]["name"] == "add"
    else:
        raise AssertionError("the reply ends after the call request")
