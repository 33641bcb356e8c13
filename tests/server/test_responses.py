"""OpenAI's Responses API (/v1/responses) on `sgnb serve` over the real default model, with the official `openai`
client (`client.responses.create`, streaming too) and `requests` against the session's loopback server: text and
message input, instructions, the typed stream, structured output, function tools, sampling, usage, errors."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
requests = pytest.importorskip("requests")

QUESTION = "What is the capital of France?"
WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
          "required": ["city", "population"], "additionalProperties": False}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _greedy(engine, messages, max_new_tokens):
    return engine.generate(engine.apply_chat_template(messages), {"max_new_tokens": max_new_tokens, "temperature": 0})


def test_text_input_with_instructions_is_the_chat_prompt(client, engine):
    """A string input and instructions are the system and user messages of a chat: the same greedy text, usage
    counted as the engine counts it, the Response object's fields."""
    expect = _greedy(engine, [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": QUESTION}],
                     12)
    r = client.responses.create(model="any", input=QUESTION, instructions="Answer briefly.", max_output_tokens=12,
                                temperature=0)
    assert r.output_text == expect["text"]
    assert r.id.startswith("resp_") and r.object == "response" and r.model == engine.model_name
    assert [item.type for item in r.output] == ["message"]
    assert r.output[0].role == "assistant" and r.output[0].content[0].type == "output_text"
    meta = expect["meta_info"]
    assert r.usage.input_tokens == meta["prompt_tokens"] and r.usage.output_tokens == meta["completion_tokens"]
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    cut = meta["finish_reason"]["type"] == "length"  # max_output_tokens ended it: OpenAI's "incomplete"
    assert r.status == ("incomplete" if cut else "completed")
    assert (r.incomplete_details.reason if cut else r.incomplete_details) == ("max_output_tokens" if cut else None)
    assert r.instructions == "Answer briefly." and r.max_output_tokens == 12 and r.temperature == 0


def test_message_list_input_answers_as_chat_completions(client):
    """Message items (content parts input_text / output_text, a past assistant turn) give what the chat route
    gives for the same conversation."""
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Hi! My name is Ada."}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello Ada!"}]},
             {"role": "user", "content": "What is my name?"}]
    chat = [{"role": "user", "content": "Hi! My name is Ada."}, {"role": "assistant", "content": "Hello Ada!"},
            {"role": "user", "content": "What is my name?"}]
    r = client.responses.create(model="any", input=items, max_output_tokens=10, temperature=0)
    c = client.chat.completions.create(model="any", messages=chat, max_tokens=10, temperature=0)
    assert r.output_text == c.choices[0].message.content and r.output_text
    assert r.usage.input_tokens == c.usage.prompt_tokens


def test_stream_events(client, server, engine):
    """The typed stream: created, in_progress, the message item and its part opened, text deltas, their .done
    events, then response.incomplete / completed holding the whole response; sequence numbers count up."""
    expect = _greedy(engine, [{"role": "user", "content": QUESTION}], 10)
    events = list(client.responses.create(model="any", input=QUESTION, max_output_tokens=10, temperature=0,
                                          stream=True))
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    end = "response.incomplete" if expect["meta_info"]["finish_reason"]["type"] == "length" else "response.completed"
    assert kinds == (["response.created", "response.in_progress", "response.output_item.added",
                      "response.content_part.added"] + ["response.output_text.delta"] * len(deltas)
                     + ["response.output_text.done", "response.content_part.done", "response.output_item.done", end])
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(d.delta for d in deltas) == expect["text"] and len(deltas) > 1
    assert events[-4].text == expect["text"] and events[-2].item.content[0].text == expect["text"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    done = events[-1].response
    assert done.output_text == expect["text"] and done.usage.output_tokens == expect["meta_info"]["completion_tokens"]
    assert len({d.item_id for d in deltas} | {events[2].item.id}) == 1

    # on the wire: SSE with an `event:` line naming each event, as OpenAI sends it; each event and the Response
    # object validate (strictly, not as the client's lenient parse) as the openai package's types
    import pydantic
    from openai.types.responses import Response, ResponseStreamEvent

    raw = requests.post(server.url + "/v1/responses", json={"input": "Hi", "max_output_tokens": 2, "stream": True},
                        timeout=120).text
    assert raw.startswith("event: response.created\ndata: {")
    blocks = [b for b in raw.split("\n\n") if b]
    for block in blocks:
        kind, data = block.split("\n")
        event = pydantic.TypeAdapter(ResponseStreamEvent).validate_json(data[len("data: "):])
        assert kind == f"event: {event.type}"
    Response.model_validate(requests.post(server.url + "/v1/responses", json={
        "input": "Hi", "max_output_tokens": 2, "tools": [WEATHER]}, timeout=120).json())


def test_structured_output(client):
    """text.format json_schema (and json_object) constrain the reply: it parses and validates."""
    r = client.responses.create(model="any", input="Name a large city and its population, in JSON.",
                                max_output_tokens=60, temperature=0,
                                text={"format": {"type": "json_schema", "name": "city", "schema": SCHEMA,
                                                 "strict": True}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), SCHEMA)
    assert r.text.format.type == "json_schema"
    r = client.responses.create(model="any", input="Describe Paris in JSON.", max_output_tokens=40, temperature=0,
                                text={"format": {"type": "json_object"}})
    if r.status == "completed":
        assert isinstance(json.loads(r.output_text), dict)
    else:  # cut by max_output_tokens: still the start of an object
        assert r.output_text.lstrip().startswith("{")


def test_function_tools(client):
    """Function tools: tool_choice required gives a function_call item whose arguments validate against the
    tool's parameters; its output goes back as function_call_output for the next turn. Streamed, the call comes
    as output_item.added, function_call_arguments.delta / .done, output_item.done."""
    r = client.responses.create(model="any", input="What is the weather in Paris?", tools=[WEATHER],
                                tool_choice="required", max_output_tokens=60, temperature=0)
    assert r.status == "completed" and [item.type for item in r.output] == ["function_call"]
    call = r.output[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    assert r.tools[0].name == "get_weather" and r.tool_choice == "required"

    follow = client.responses.create(model="any", tools=[WEATHER], max_output_tokens=20, temperature=0, input=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "18 C and sunny"}], tool_choice="none")
    assert follow.output[0].type == "message" and follow.output_text

    named = client.responses.create(model="any", input="Weather in Rome?", tools=[WEATHER], max_output_tokens=60,
                                    tool_choice={"type": "function", "name": "get_weather"}, temperature=0)
    assert named.output[0].type == "function_call" and named.output[0].name == "get_weather"

    events = list(client.responses.create(model="any", input="What is the weather in Paris?", tools=[WEATHER],
                                          tool_choice="required", max_output_tokens=60, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    assert events[4].arguments == call.arguments and events[5].item.type == "function_call"
    assert events[-1].response.output[0].arguments == call.arguments


def test_sampling_values_apply(client, engine):
    """temperature and top_p reach the sampler: a tiny top_p is greedy at temperature 1; max_output_tokens caps."""
    expect = _greedy(engine, [{"role": "user", "content": "Tell me a story."}], 6)
    r = client.responses.create(model="any", input="Tell me a story.", max_output_tokens=6, temperature=1.0,
                                top_p=1e-6)
    assert r.output_text == expect["text"] and r.top_p == 1e-6
    assert r.usage.output_tokens <= 6


@pytest.mark.parametrize("kwargs, needle", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"tools": [{"type": "web_search"}]}, "function tools only"),
    ({"input": [{"type": "file_search_call", "id": "x"}]}, "file_search_call"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "schema"),
    ({"text": {"format": {"type": "yaml"}}}, "response_format"),
    ({"temperature": -1.0}, "temperature"),
    ({"extra_body": {"bogus": 1}}, "bogus"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "nope"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]},
     "text-only model"),  # images go the chat route's way: this model takes none
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input_file"),
    ({"input": []}, "no message"),
])
def test_bad_requests_are_400(client, kwargs, needle):
    with pytest.raises(openai.BadRequestError, match=needle):
        client.responses.create(**{"model": "any", "input": "Hi", "max_output_tokens": 4, **kwargs})


def test_reasoning_then_answer_events_are_openai_events():
    """With a reasoning parser (`sgnb serve --reasoning-parser`) the thinking streams as a "reasoning" item before the
    message: each item opened, its deltas, closed before the next opens; every event parses as the openai
    client's own type for it."""
    import pydantic
    from openai.types.responses import ResponseStreamEvent

    from sgnb.server.responses_api import _EventWriter

    w = _EventWriter("b")
    raw = w.text("reasoning", "Let me ") + w.text("reasoning", "think.") + w.text("message", "Paris") + w.close()
    raw += w.function_call({"id": "call_1", "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}})
    datas = [json.loads(chunk.split(b"\ndata: ", 1)[1]) for chunk in raw]
    events = [pydantic.TypeAdapter(ResponseStreamEvent).validate_python(d) for d in datas]
    assert [e.type for e in events] == [
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[4].text == "Let me think." and events[6].item.type == "reasoning"
    assert events[10].text == "Paris" and events[12].output_index == 1
    assert [i["type"] for i in w.items] == ["reasoning", "message", "function_call"]
    assert events[-1].item.call_id == "call_1" and events[-1].output_index == 2
