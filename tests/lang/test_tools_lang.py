"""Tool calls in the language: gen(tools=..., tool_choice=...), system(..., tools=...), tool(result), on the real
default model in-process (Runtime), over `sgnb serve`'s native API (RuntimeEndpoint) and over its OpenAI API (a
completion model: the same text protocol; a chat model: the server's own tool calling). Structure is asserted
(the call parses, names an allowed function, its arguments validate against the function's schema; the
messages are OpenAI's shape), not what a 135M model knows."""

from __future__ import annotations

import json

import pytest

import sgnb as sgl
from sgnb.backends.base import GenContext
from sgnb.sampling import GenParams
from sgnb.tools import TOOL_CALL_OPEN

ENGINE = "default"  # its assertions hold for any model: the quantized engine (tests/conftest.py)

jsonschema = pytest.importorskip("jsonschema")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
SYSTEM = "You are a helpful assistant."


@pytest.fixture(scope="module", params=["runtime", "endpoint", "openai-completion", "openai-chat"])
def backend(request, engine):
    if request.param == "runtime":
        return sgl.Runtime(engine=engine)
    server = request.getfixturevalue("server")
    if request.param == "endpoint":
        return sgl.RuntimeEndpoint(server.url)
    return sgl.OpenAI(engine.model_name, base_url=server.url + "/v1", api_key="local",
                      is_chat_model=request.param == "openai-chat", max_retries=0)


def _check_call(call: dict, name: str | None = None) -> dict:
    """An OpenAI-shaped call: an id, type function, an allowed name, arguments valid for its schema."""
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"]["name"] in SCHEMAS
    if name is not None:
        assert call["function"]["name"] == name
    args = json.loads(call["function"]["arguments"])
    jsonschema.validate(args, SCHEMAS[call["function"]["name"]])
    return args


@sgl.function
def agent(s, question, tool_choice):
    """Model -> call -> tool result -> answer."""
    s += sgl.system(SYSTEM, tools=TOOLS)
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("call", tools=TOOLS, tool_choice=tool_choice, max_tokens=60))
    for call in s.tool_calls("call"):
        s += sgl.tool({"result": "18 C, sunny" if call["function"]["name"] == "get_weather" else 5})
    s += sgl.assistant(sgl.gen("answer", max_tokens=16))


def test_required_call_then_tool_result_then_answer(backend):
    st = agent.run(question="What is the weather in Paris?", tool_choice="required", temperature=0,
                   backend=backend)
    assert st.error() is None, st.error()
    (call,) = st.tool_calls("call")
    _check_call(call)
    assert st.get_meta_info("call")["tool_calls"] == [call]
    system, user, asked, result, answer = st.messages()
    # OpenAI's message shapes: the descriptions and the call are in the text, not in the contents
    assert system == {"role": "system", "content": SYSTEM}
    assert user["role"] == "user"
    assert asked == {"role": "assistant", "content": "", "tool_calls": [call]}
    assert result["role"] == "tool" and result["tool_call_id"] == call["id"]
    assert json.loads(result["content"]) in ({"result": "18 C, sunny"}, {"result": 5})
    assert answer["role"] == "assistant" and isinstance(st["answer"], str)
    text = st.text()
    assert st["call"].startswith(TOOL_CALL_OPEN + "\n") and st["call"].endswith("\n</tool_call>")
    assert st["call"] in text and "You can call functions" in text
    # the tool message rendered through the chat template (SmolLM2's takes any role)
    assert "<|im_start|>tool\n" + result["content"] + "<|im_end|>\n<|im_start|>assistant\n" in text


def test_named_function(backend):
    st = agent.run(question="Add 2 and 3.", tool_choice={"type": "function", "function": {"name": "add"}},
                   temperature=0, backend=backend)
    assert st.error() is None, st.error()
    args = _check_call(st.tool_calls("call")[0], name="add")
    assert isinstance(args["a"], int) and isinstance(args["b"], int)


def test_auto_is_text_or_a_valid_call(backend):
    st = agent.run(question="What is the weather in Paris?", tool_choice="auto", temperature=0, backend=backend)
    assert st.error() is None, st.error()
    calls = st.tool_calls("call")
    asked = st.messages()[2]
    if calls:
        _check_call(calls[0])
        assert asked["tool_calls"] == calls and st.messages()[3]["role"] == "tool"
    else:
        assert "tool_calls" not in asked and asked["content"] == st["call"]
        assert [m["role"] for m in st.messages()] == ["system", "user", "assistant", "assistant"]


class _Opens(sgl.Runtime):
    """The in-process engine, except that the "auto" text pass replies `opening` and stops where a call opens
    (as a model that calls would): the interpreter must switch to the constrained call there."""

    def __init__(self, engine, opening: str, matched: str) -> None:
        super().__init__(engine=engine)
        self.opening, self.matched = opening, matched

    def generate(self, ctx: GenContext, params: GenParams) -> tuple[str, dict]:
        if params.stop and TOOL_CALL_OPEN in params.stop:
            return self.opening, {"prompt_tokens": 10, "completion_tokens": 3, "cached_tokens": 0,
                                  "finish_reason": {"type": "stop", "matched": self.matched}}
        return super().generate(ctx, params)


@pytest.mark.parametrize("opening, matched", [("Let me check. ", TOOL_CALL_OPEN), ("", '{"name":')],
                         ids=["tagged", "bare"])
def test_auto_switches_to_a_constrained_call_where_one_opens(engine, opening, matched):
    @sgl.function
    def ask(s):
        s += sgl.system(SYSTEM, tools=TOOLS)
        s += sgl.user("What is the weather in Paris?")
        s += sgl.assistant(sgl.gen("call", tools=TOOLS, max_tokens=60))

    st = ask.run(temperature=0, backend=_Opens(engine, opening, matched))
    assert st.error() is None, st.error()
    (call,) = st.tool_calls("call")
    _check_call(call)
    tail = st["call"][len(opening):]
    if matched == TOOL_CALL_OPEN:
        assert tail.startswith(TOOL_CALL_OPEN + "\n") and tail.endswith("\n</tool_call>")
    else:
        assert tail.lstrip().startswith("{") and "<tool_call>" not in tail  # the model's own format
    assert st.messages()[-1] == {"role": "assistant", "content": opening, "tool_calls": [call]}
    meta = st.get_meta_info("call")
    assert meta["prompt_tokens"] == 10 and meta["completion_tokens"] > 3  # both requests counted


def test_tool_descriptions_render_as_the_server_renders_them(engine):
    """One rendering: a program's system(..., tools=...) + user text is the prompt `sgnb serve` builds for the
    same messages and tools (sgnb's tool prompt in the system message, for SmolLM2's template)."""
    from sgnb.server.access import ServerOptions
    from sgnb.server.app import _Server
    from sgnb.server.media import _Media
    from sgnb.server.protocol import _tool_plan

    @sgl.function
    def prompt(s):
        s += sgl.system(SYSTEM, tools=TOOLS)
        s += sgl.user("What is the weather in Paris?")
        s += sgl.assistant_begin()

    mine = prompt.run(backend=sgl.Runtime(engine=engine)).text()
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is the weather in Paris?"}]
    media = _Media(engine)
    theirs, _, _ = _Server(engine, ServerOptions())._render_chat(messages, media, _tool_plan(TOOLS, "auto"))
    assert mine == theirs


def test_tool_role_from_the_chat_template(engine):
    """The "tool" role's prefix and suffix come from the model's template; a template without that role gets the
    result as a user message holding <tool_response>; a template that writes tools after the system content
    (Qwen's way) has its own descriptions used."""
    from sgnb.chat_template import derive_from_jinja
    from sgnb.engine.tokenizer import Tokenizer

    assert sgl.Runtime(engine=engine).get_chat_template().prefix_and_suffix("tool") == (
        "<|im_start|>tool\n", "<|im_end|>\n")
    no_tool_role = ("{% for m in messages %}{% if m.role not in ['system', 'user', 'assistant'] %}"
                    "{{ raise_exception('no such role') }}{% endif %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    qwen_like = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                 "{% if m.role == 'system' and tools %}{{ '\\n\\n# Tools' }}{% for t in tools %}"
                 "{{ '\\n' + t.function.name }}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

    def template(source: str):
        tok = Tokenizer(engine.tokenizer._tk, chat_template=source)
        return derive_from_jinja(lambda m, g, **kw: tok.apply_chat_template(m, add_generation_prompt=g, **kw))

    plain = template(no_tool_role)
    assert plain.prefix_and_suffix("tool") == ("<|im_start|>user\n<tool_response>\n",
                                               "\n</tool_response><|im_end|>\n")
    assert plain.tools_text(TOOLS, {}, after_content=True).startswith("\n\nYou can call functions")
    qwen = template(qwen_like)
    assert qwen.tools_text(TOOLS, {}, after_content=True) == "\n\n# Tools\nget_weather\nadd"
    assert qwen.tools_text(TOOLS, {}, after_content=False) == "# Tools\nget_weather\nadd"


@pytest.mark.parametrize("kw, needle", [
    ({"tool_choice": "required"}, "tool_choice needs tools"),
    ({"tools": []}, "tools is an empty list"),
    ({"tools": WEATHER}, "tools must be a list"),
    ({"tools": [{"type": "function"}]}, r"tools\[0\] must be"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, r"tools\[0\]\.function\.name"),
    ({"tools": [ADD, ADD]}, "two functions are named 'add'"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice must be"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"$ref": "#/$defs/Missing"}}}}}]}, "not a usable JSON schema"),
    ({"tools": TOOLS, "regex": "[a-z]+"}, "cannot be combined"),
    ({"tools": TOOLS, "dtype": int}, "cannot be combined"),
    ({"tools": TOOLS, "n": 2}, "one sample"),
    ({"tools": TOOLS, "choices": ["a", "b"]}, "cannot call tools"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_bad_tool_specs_raise_at_the_gen_call(kw, needle):
    with pytest.raises(ValueError, match=needle):
        sgl.gen("call", **kw)  # gen() itself raises, at the program's line, before anything runs


def test_bad_tools_in_a_system_message_raise_there():
    with pytest.raises(ValueError, match=r"system\(tools=...\): tools\[0\] must be"):
        sgl.system("x", tools=[{"type": "function"}])


def test_tool_message_answers_the_named_call(engine):
    """tool(result, tool_call_id=...) answers that call; without one, the next unanswered call."""

    @sgl.function
    def answered(s):
        s += sgl.user("hi")
        s += sgl.assistant("ok")
        s += sgl.tool("first", tool_call_id="call_a")
        with s.tool():
            s += "second"

    st = answered.run(backend=sgl.Runtime(engine=engine))
    assert st.messages()[-2:] == [{"role": "tool", "content": "first", "tool_call_id": "call_a"},
                                  {"role": "tool", "content": "second"}]
    assert "<|im_start|>tool\nsecond<|im_end|>\n" in st.text()
