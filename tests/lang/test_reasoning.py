"""Reasoning models (sgnb/reasoning.py): the thinking split from the answer by SGLang's parser names, in the
language (`separate_reasoning` around any expression; SGLang's own frontend on the same server as the oracle),
in `sgnb serve`'s chat completions (reasoning_content, streamed as delta.reasoning_content, the `openai` client as
the reader) and in the engine (a grammar that starts where the reasoning ends). The default model does not think
by itself: a regex forces a `<think>` block into its reply."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import sgnb as sgl
from sgnb.reasoning import FORMATS, ReasoningStream, reasoning_format, split_reasoning

ENGINE = "default"  # its assertions hold for any model: the quantized engine (tests/conftest.py)

THINKING = r"<think>[a-z]{3,12}</think>The answer is [0-9]"  # a reply with a reasoning block, whatever the model
REPLIES = {
    "qwen3": ["<think>\nplan it\n</think>\n\nThe answer", "no thinking at all", "<think>cut off mid-thought"],
    "deepseek-r1": ["started inside</think>The answer", "<think>opened again</think>x", "never closed"],
    "mistral": ["[THINK]hmm[/THINK]Answer.", "Answer only."],
    "kimi": ["◁think▷a◁/think▷b"],
    "gpt-oss": ["<|channel|>analysis<|message|>think it<|end|><|start|>assistant<|channel|>final<|message|>"
                "Answer<|return|>"],
}


# ---- the parsers -----------------------------------------------------------------------------------------------
def test_the_splits_are_sglangs():
    """Each reply splits as SGLang's own parser of the same name splits it."""
    parser = pytest.importorskip("sglang.srt.parser.reasoning_parser")
    for name, replies in REPLIES.items():
        for text in replies:
            assert split_reasoning(text, name) == tuple(parser.ReasoningParser(name).parse_non_stream(text)), \
                (name, text)


def test_unknown_parser_names_are_refused_with_the_known_ones():
    with pytest.raises(ValueError, match="unknown reasoning parser 'qwen9'.*deepseek-r1"):
        reasoning_format("qwen9")
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        sgl.separate_reasoning(sgl.gen("a"), model_type="qwen9")  # at the user's line, not when it runs


@settings(max_examples=200, deadline=None)
@given(name=st.sampled_from(sorted(n for n in FORMATS if n != "auto")), data=st.data())
def test_streamed_splits_add_up_to_the_whole_split(name, data):
    """However a reply arrives in pieces, the streamed reasoning and answer add up to split_reasoning's."""
    fmt = FORMATS[name]
    parts = data.draw(st.lists(st.sampled_from(["x", " ", "\n", "ab", fmt.open, fmt.close, fmt.open[:3],
                                                fmt.close[:4], fmt.close[4:], "<", "[", "|"]), max_size=12))
    text = "".join(parts)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    stream, reasoning, answer, last = ReasoningStream(fmt), "", "", 0
    for cut in [*cuts, len(text)]:
        r, a = stream.feed(text[last:cut])
        reasoning, answer, last = reasoning + r, answer + a, cut
    r, a = stream.finish()
    assert (reasoning + r, answer + a) == split_reasoning(text, fmt)


# ---- the language ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def backend(engine):
    return sgl.Runtime(engine=engine)


@sgl.function
def thinker(s, question, wrap_role):
    s += sgl.user(question)
    reply = sgl.gen("answer", regex=THINKING, max_tokens=40, temperature=0)
    if wrap_role:  # SGLang's documented form: the whole assistant turn
        s += sgl.separate_reasoning(sgl.assistant(reply), model_type="qwen3")
    else:
        s += sgl.assistant_begin()
        s += sgl.separate_reasoning(reply, model_type="qwen3")
        s += sgl.assistant_end()
    s += sgl.user("And again?")


@pytest.mark.parametrize("wrap_role", [True, False], ids=["around-a-role", "around-a-gen"])
def test_separate_reasoning_takes_the_thinking_out_of_the_conversation(backend, wrap_role):
    state = thinker.run(question="What is 2 + 2?", wrap_role=wrap_role, backend=backend)
    assert state["answer"].startswith("The answer is ") and "<think>" not in state["answer"]
    thought = state["answer_reasoning_content"]
    assert thought.isalpha() and 3 <= len(thought) <= 12
    assert "<think>" not in state.text() and thought not in state.text()
    assistant = [m for m in state.messages() if m["role"] == "assistant"]
    assert assistant[-1]["content"] == state["answer"]
    assert state.messages()[-1] == {"role": "user", "content": "And again?"}


def test_a_reply_without_reasoning_still_sets_the_variable(backend):
    @sgl.function
    def plain(s):
        s += "Count: " + sgl.separate_reasoning(sgl.gen("n", regex="[0-9]{2}", temperature=0), model_type="qwen3")

    state = plain.run(backend=backend)
    assert state["n_reasoning_content"] == "" and len(state["n"]) == 2
    assert "n_reasoning_content" in state.stream_executor.variable_event


def test_sglangs_frontend_on_sgnb_serve_splits_the_same(backend, server):
    """SGLang's own frontend (its separate_reasoning over its RuntimeEndpoint, on sgnb serve) is the oracle."""
    sglang = pytest.importorskip("sglang")
    pytest.importorskip("sglang.srt.parser.reasoning_parser")
    from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint

    @sglang.function
    def theirs(s):
        s += "Think, then answer.\n"
        s += sglang.separate_reasoning(sglang.gen("answer", regex=THINKING, max_tokens=40, temperature=0),
                                       model_type="qwen3")

    @sgl.function
    def ours(s):
        s += "Think, then answer.\n"
        s += sgl.separate_reasoning(sgl.gen("answer", regex=THINKING, max_tokens=40, temperature=0),
                                    model_type="qwen3")

    a = theirs.run(backend=RuntimeEndpoint(server.url))
    b = ours.run(backend=backend)
    assert (b["answer"], b["answer_reasoning_content"]) == (a["answer"], a["answer_reasoning_content"])
    # SGLang rewrites its text from the open role's start (none here: it keeps both copies of the answer);
    # ours takes out only the reasoning
    assert b.text() == "Think, then answer.\n" + b["answer"]


# ---- the server ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reasoning_server(engine):
    from sgnb.server import start_server_thread

    engine.reasoning_parser = "qwen3"
    handle = start_server_thread(engine, "127.0.0.1", 0)
    yield handle
    handle.stop()
    engine.reasoning_parser = None


def test_chat_completions_return_the_thinking_apart(reasoning_server):
    """The `openai` client reads message.reasoning_content and, streamed, delta.reasoning_content; a request
    with separate_reasoning=false gets the reply whole. (The template variable keeps the regex from waiting for
    the reasoning: it forces the block itself.)"""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=reasoning_server.url + "/v1", api_key="none")
    kw = dict(model="default", messages=[{"role": "user", "content": "What is 2 + 2?"}], temperature=0,
              max_tokens=40)
    extra = {"regex": THINKING, "chat_template_kwargs": {"enable_thinking": False}}
    whole = client.chat.completions.create(**kw, extra_body={**extra, "separate_reasoning": False})
    text = whole.choices[0].message.content
    reasoning, answer = split_reasoning(text, "qwen3")
    assert reasoning and answer.startswith("The answer is ")
    apart = client.chat.completions.create(**kw, extra_body=extra).choices[0].message
    assert (apart.content, apart.reasoning_content) == (answer, reasoning)
    pieces = {"reasoning_content": "", "content": ""}
    for chunk in client.chat.completions.create(**kw, extra_body=extra, stream=True):
        for c in chunk.choices:
            delta = c.delta.model_dump()
            for key in pieces:
                pieces[key] += delta.get(key) or ""
    assert pieces == {"reasoning_content": reasoning, "content": answer}


def test_chat_template_kwargs_reach_the_template_and_reserved_names_are_refused(reasoning_server):
    import requests

    url = reasoning_server.url + "/v1/chat/completions"
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    bad = requests.post(url, json={**body, "chat_template_kwargs": {"add_generation_prompt": False}}, timeout=60)
    assert bad.status_code == 400 and "chat_template_kwargs" in bad.text
    assert requests.post(url, json={**body, "chat_template_kwargs": {"enable_thinking": True}},
                         timeout=60).status_code == 200


# ---- the engine ------------------------------------------------------------------------------------------------
def test_a_grammar_after_the_reasoning_starts_at_its_marker(engine):
    """With grammar_after, the reply is free (greedy: the same tokens as unconstrained) up to the marker, and
    the constraint holds from there on."""
    prompt = "Write a short poem about the sea:\n"
    free = engine.generate(prompt, {"max_new_tokens": 12, "temperature": 0})
    marker = engine.tokenizer.decode(free["output_ids"][:3])
    assert marker.strip(), free
    out = engine.generate(prompt, {"max_new_tokens": 12, "temperature": 0, "regex": "[0-9]{4}",
                                   "grammar_after": marker})
    assert out["text"].startswith(marker) and out["output_ids"][:3] == free["output_ids"][:3]
    assert out["text"][len(marker):].isdigit() and len(out["text"]) - len(marker) == 4, out["text"]
    assert out["meta_info"]["finish_reason"]["type"] == "stop"


# ---- tool calls after the reasoning ----------------------------------------------------------------------------
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
THOUGHT = "I should call the weather tool."
# one earlier turn that thought, then called: the default model (which does not think by itself) follows it
FEW_SHOT = [{"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": f'<think>{THOUGHT}</think>\n<tool_call>\n{{"name": "get_weather", '
                                             '"arguments": {"city": "Paris"}}\n</tool_call>'},
            {"role": "tool", "content": "sunny"},
            {"role": "user", "content": "What is the weather in Rome?"}]


def _check_weather_call(call) -> None:
    import json

    assert call["function"]["name"] == "get_weather"
    assert isinstance(json.loads(call["function"]["arguments"])["city"], str)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_a_required_tool_call_comes_after_the_reasoning(reasoning_server, tool_choice):
    """With a reasoning parser, a required call's grammar starts at the reasoning's closing marker (the engine's
    grammar_after): the model thinks freely first (its thinking comes back as reasoning_content, whole and
    streamed), then the call decodes under the schema."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=reasoning_server.url + "/v1", api_key="none")
    kw = dict(model="default", messages=FEW_SHOT, tools=[WEATHER], tool_choice=tool_choice, temperature=0,
              max_tokens=60)
    reply = client.chat.completions.create(**kw)
    message = reply.choices[0].message
    assert message.reasoning_content == THOUGHT and not message.content
    assert reply.choices[0].finish_reason == "tool_calls"
    (call,) = message.tool_calls
    _check_weather_call(call.model_dump())
    pieces, calls = {"reasoning_content": "", "content": ""}, []
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            delta = c.delta.model_dump()
            for key in pieces:
                pieces[key] += delta.get(key) or ""
            calls += delta.get("tool_calls") or []
    assert pieces == {"reasoning_content": THOUGHT, "content": ""}
    assert [c["function"] for c in calls] == [call.model_dump()["function"]]
    # thinking turned off in the template: the call is decoded from the start, as without a parser
    off = client.chat.completions.create(**kw, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.choices[0].message.reasoning_content is None
    _check_weather_call(off.choices[0].message.tool_calls[0].model_dump())


def test_an_auto_tool_call_after_the_reasoning_keeps_the_thinking_apart(reasoning_server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=reasoning_server.url + "/v1", api_key="none")
    reply = client.chat.completions.create(model="default", messages=FEW_SHOT, tools=[WEATHER], temperature=0,
                                           max_tokens=60)
    message = reply.choices[0].message
    assert message.reasoning_content == THOUGHT and "<think>" not in (message.content or "")
    (call,) = message.tool_calls
    _check_weather_call(call.model_dump())


def test_gen_tools_after_the_reasoning(backend):
    """gen(tools=..., tool_choice="required") inside separate_reasoning: one request, free up to </think> and the
    call's schema from there on; the thinking goes to NAME_reasoning_content, the call to the meta_info and the
    message, and the program's variables and their events are where SGLang's frontend looks for them
    (`state.stream_executor.variables` / `.variable_event`)."""
    @sgl.function
    def weather(s):
        for m in FEW_SHOT[:2]:
            s += {"user": sgl.user, "assistant": sgl.assistant}[m["role"]](m["content"])
        s += sgl.tool("sunny")
        s += sgl.user(FEW_SHOT[-1]["content"])
        s += sgl.separate_reasoning(sgl.assistant(sgl.gen("call", tools=[WEATHER], tool_choice="required",
                                                          max_tokens=60, temperature=0)), model_type="qwen3")

    state = weather.run(backend=backend)
    assert state["call_reasoning_content"] == THOUGHT
    (call,) = state.tool_calls("call")
    _check_weather_call(call)
    assert state.text().count("<think>") == 1 and "<think>" not in state["call"]  # the earlier turn's only
    assert state.messages()[-1]["tool_calls"] == [call]
    executor = state.stream_executor
    assert executor.variables["call_reasoning_content"] == THOUGHT
    assert executor.variable_event["call"].is_set() and executor.variable_event["call_reasoning_content"].is_set()
