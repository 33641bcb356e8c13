"""Tool calling on /v1/chat/completions over the real default model, with the official `openai` client against a
loopback `sgnb serve` (the session's `server` fixture): tool_choice required / named / auto / none, streaming,
tool history, the chat-template paths (sgnb's fallback format for SmolLM2's template, and a template that renders
tools), errors."""

from __future__ import annotations

import functools
import json
import types

import pytest

ENGINE = "default"  # its assertions hold for any model: the quantized engine (tests/conftest.py)

jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"max_tokens": 60, "temperature": 0}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _check_call(call, schemas=SCHEMAS, name=None) -> dict:
    """A tool call as OpenAI returns one: an id, type function, a known name, arguments valid for its schema."""
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name in schemas
    if name is not None:
        assert call.function.name == name
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, schemas[call.function.name])
    return args


def test_required_gives_a_call_valid_against_its_schema(client):
    r = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="required", **GREEDY)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None and len(choice.message.tool_calls) == 1
    _check_call(choice.message.tool_calls[0])
    assert r.usage.completion_tokens > 0 and r.usage.prompt_tokens > 0


def test_named_function(client):
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Add 2 and 3."}], tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "add"}}, **GREEDY)
    assert r.choices[0].finish_reason == "tool_calls"
    args = _check_call(r.choices[0].message.tool_calls[0], name="add")
    assert isinstance(args["a"], int) and isinstance(args["b"], int)


def test_none_answers_in_text(client):
    r = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="none", **GREEDY)
    msg = r.choices[0].message
    assert not msg.tool_calls and isinstance(msg.content, str) and msg.content
    assert r.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("messages", [
    ASK,
    ASK + [{"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}],
], ids=["question", "after-a-tool-result"])
def test_auto_is_text_or_a_valid_call(client, messages):
    r = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, **GREEDY)  # tool_choice: auto
    choice = r.choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        _check_call(choice.message.tool_calls[0])
    else:
        assert choice.finish_reason in ("stop", "length") and isinstance(choice.message.content, str)


def test_n_choices_each_call(client):
    r = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="required", n=2,
                                       max_tokens=60, temperature=0.8, seed=1)
    assert len(r.choices) == 2
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls"
        _check_call(choice.message.tool_calls[0])


def _stream(client, **kw) -> tuple[str, dict[int, dict], str | None, list]:
    """Accumulate a stream as a client does: the content, the tool calls by index, the finish reason."""
    content, calls, finish, chunks = "", {}, None, []
    for chunk in client.chat.completions.create(model="m", stream=True, stream_options={"include_usage": True},
                                                **kw):
        chunks.append(chunk)
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        content += c.delta.content or ""
        for tc in c.delta.tool_calls or []:
            acc = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            acc["id"] = tc.id or acc["id"]
            acc["name"] += (tc.function.name or "") if tc.function else ""
            acc["arguments"] += (tc.function.arguments or "") if tc.function else ""
        finish = c.finish_reason or finish
    return content, calls, finish, chunks


def test_stream_required(client):
    content, calls, finish, chunks = _stream(client, messages=ASK, tools=TOOLS, tool_choice="required", **GREEDY)
    assert finish == "tool_calls" and content == "" and list(calls) == [0]
    call = calls[0]
    assert call["id"].startswith("call_") and call["name"] in SCHEMAS
    jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def test_stream_matches_non_stream(client):
    """auto, greedy: the stream's content / call is the non-streamed reply's."""
    r = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, **GREEDY)
    content, calls, finish, _ = _stream(client, messages=ASK, tools=TOOLS, **GREEDY)
    assert finish == r.choices[0].finish_reason
    if r.choices[0].message.tool_calls:
        assert calls[0]["name"] == r.choices[0].message.tool_calls[0].function.name
        assert json.loads(calls[0]["arguments"]) == json.loads(r.choices[0].message.tool_calls[0].function.arguments)
    else:
        assert content == r.choices[0].message.content and not calls


def test_auto_switches_to_a_constrained_call_where_one_opens(engine):
    """The "auto" mechanism on a reply that opened a call: the text before it is the content, and the call is
    decoded under the tools' schema, whatever the model would have written freely."""
    import asyncio

    from sgnb.server.access import ServerOptions
    from sgnb.server.app import _Server
    from sgnb.server.protocol import _tool_plan

    routes = _Server(engine, ServerOptions())
    plan = _tool_plan(TOOLS, "auto")
    text = engine.apply_chat_template(ASK)

    async def opened() -> object:  # an engine stream whose reply stopped at "<tool_call>"
        yield {"text": "Let me check. ", "meta_info": {}}
        yield {"text": "", "output_ids": [1, 2, 3], "meta_info": {
            "prompt_tokens": 10, "completion_tokens": 3, "cached_tokens": 0,
            "finish_reason": {"type": "stop", "matched": "<tool_call>"}}}

    async def run() -> list[dict]:
        sp = {"max_new_tokens": 60, "temperature": 0}
        return [c async for c in routes._tool_sample(plan, text, opened(), sp, "t-auto", {}, {})]

    chunks = asyncio.run(run())
    assert chunks[0]["text"] == "Let me check. " and "output_ids" not in chunks[0]
    last = chunks[-1]
    (call,) = last["tool_calls"]
    assert call["function"]["name"] in SCHEMAS
    jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
    assert last["meta_info"]["prompt_tokens"] == 10 and last["meta_info"]["completion_tokens"] > 3


def test_defs_in_parameters_resolve(client):
    """A function whose parameters use $defs / $ref (as pydantic writes them) still constrains correctly."""
    params = {"type": "object", "properties": {"where": {"$ref": "#/$defs/Place"}}, "required": ["where"],
              "$defs": {"Place": {"type": "object", "properties": {"city": {"type": "string"},
                                                                    "country": {"type": "string"}},
                                  "required": ["city", "country"]}}}
    tool = {"type": "function", "function": {"name": "locate", "parameters": params}}
    r = client.chat.completions.create(model="m", messages=ASK, tools=[tool], tool_choice="required", **GREEDY)
    _check_call(r.choices[0].message.tool_calls[0], {"locate": params})


def _routes_over(tokenizer):
    from sgnb.engine.engine import Engine
    from sgnb.server.access import ServerOptions
    from sgnb.server.app import _Server

    fake = types.SimpleNamespace(tokenizer=tokenizer, get_stats=lambda: {"kv_total": 0}, image_token=None,
                                 video_token=None, chat_template_kwargs={})
    fake.apply_chat_template = functools.partial(Engine.apply_chat_template, fake)  # the engine's own render
    return _Server(fake, ServerOptions())


HISTORY = ASK + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
]


def test_fallback_rendering(engine):
    """SmolLM2's template renders no tools: the tools go into the system message, past calls into the
    assistant's content in sgnb's format, the result as a "tool" message (the template takes any role)."""
    from sgnb.server.media import _Media
    from sgnb.server.protocol import _tool_plan

    routes = _routes_over(engine.tokenizer)
    assert routes._tool_support == (False, True)
    media = _Media(engine)
    text, _, _ = routes._render_chat(HISTORY, media, _tool_plan(TOOLS, "auto"))
    assert text.startswith("<|im_start|>system\nYou can call functions")
    assert '"name": "get_weather"' in text and '"name": "add"' in text  # both schemas listed
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n' \
           '</tool_call><|im_end|>' in text
    assert "<|im_start|>tool\n18 C, sunny<|im_end|>" in text
    media = _Media(engine)  # tool_choice none: no tool list, the history still renders
    text, _, _ = routes._render_chat(HISTORY, media, None)
    assert "You can call functions" not in text and "<tool_call>" in text


# a template that renders tools, tool calls and tool results (as transformers passes them)
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>\n"
    "{% endif %}{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
    "{%- for c in m.tool_calls or [] %}CALL {{ c.function.name }} {{ c.function.arguments | tojson }}"
    "{% endfor %}{% if m.role == 'tool' %} (from {{ m.name }}, {{ m.tool_call_id }}){% endif %}<|im_end|>\n"
    "{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_native_template_rendering(engine):
    from sgnb.engine.tokenizer import Tokenizer
    from sgnb.server.media import _Media
    from sgnb.server.protocol import _tool_plan

    tok = Tokenizer(engine.tokenizer._tk, chat_template=TOOLS_TEMPLATE)
    routes = _routes_over(tok)
    assert routes._tool_support[0] is True
    media = _Media(engine)
    text, _, _ = routes._render_chat(HISTORY, media, _tool_plan(TOOLS, "required"))
    assert text.startswith("<|im_start|>system\nTools: get_weather add<|im_end|>")
    assert 'CALL get_weather {"city": "Paris"}' in text  # arguments parsed from their JSON string
    assert "18 C, sunny (from get_weather, call_1)" in text
    assert "You can call functions" not in text


@pytest.mark.parametrize("kw, needle", [
    ({"tool_choice": "required"}, "tool_choice needs tools"),
    ({"tools": [], "tool_choice": "auto"}, "tools is an empty list"),
    ({"tools": [{"type": "function"}]}, "tools[0] must be"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [ADD, ADD]}, "two functions are named 'add'"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice must be"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"$ref": "#/$defs/Missing"}}}}}]}, "not a usable JSON schema"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "together with tools"),
    ({"extra_body": {"functions": [{"name": "f"}]}}, "functions / function_call"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_bad_tool_requests_are_400(client, kw, needle):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=ASK, max_tokens=4, **kw)
    assert needle in str(info.value)
    # and the server keeps serving
    assert client.chat.completions.create(model="m", messages=ASK, max_tokens=2).choices[0].message.content


def test_bad_history_is_400(client):
    bad = ASK + [{"role": "assistant", "content": None, "tool_calls": "get_weather"}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=bad, tools=TOOLS, max_tokens=4)
    assert "tool_calls must be a list" in str(info.value)
