"""DSPy on sgnb, on the real default model (135M): `sgnb.dspy.LM` in-process (Predict, ChainOfThought, typed outputs,
response_format through constrained decoding, the calls in the engine's events and radix tree), over another
sgnb backend, and plain DSPy + LiteLLM against `sgnb serve` with the README's configuration. Asserts structure
(the fields parse to their types), not knowledge."""

from __future__ import annotations

import json
import os
from typing import Literal

import pytest

ENGINE = "default"  # its assertions hold for any model: the quantized engine (tests/conftest.py)

# LiteLLM (and DSPy's model metadata) fetch a model map from the internet unless told to use the bundled one
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

dspy = pytest.importorskip("dspy")

pytestmark = [
    # DSPy 3.4 deprecates the BaseLM.forward() plugin interface (sgnb.dspy.LM's) and messages= dicts for 3.5
    pytest.mark.filterwarnings("ignore:Implementing custom LMs through BaseLM:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:Passing OpenAI-style message:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:.*using the `ReadOnly` qualifier:UserWarning"),  # LiteLLM's types
]


class Sum(dspy.Signature):
    """Add the two numbers."""

    a: int = dspy.InputField()
    b: int = dspy.InputField()
    total: int = dspy.OutputField()


class Sentiment(dspy.Signature):
    """Classify the sentiment of the text."""

    text: str = dspy.InputField()
    label: Literal["positive", "negative"] = dspy.OutputField()


@pytest.fixture(scope="module")
def lm(engine):
    import sgnb.dspy

    return sgnb.dspy.LM(engine, temperature=0, max_tokens=150)


@pytest.mark.parametrize("adapter", ["json", "chat"])
def test_predict_typed_int(lm, adapter):
    """An int output parses: JSONAdapter sends the signature's schema; ChatAdapter's free text falls back to it."""
    adapter_obj = dspy.JSONAdapter() if adapter == "json" else dspy.ChatAdapter()
    with dspy.context(lm=lm, adapter=adapter_obj):
        pred = dspy.Predict(Sum)(a=2, b=3)
    assert isinstance(pred.total, int)
    if adapter == "json":
        assert "response_format" in lm.history[-1]["kwargs"]


def test_chain_of_thought_literal(lm):
    with dspy.context(lm=lm, adapter=dspy.JSONAdapter()):
        pred = dspy.ChainOfThought(Sentiment)(text="I loved every minute of it.")
    assert pred.label in ("positive", "negative")
    assert isinstance(pred.reasoning, str)


def test_string_signature_with_chat_adapter(lm):
    with dspy.context(lm=lm):  # DSPy's default adapter
        pred = dspy.ChainOfThought("question -> answer: float")(question="What is half of 3?")
    assert isinstance(pred.answer, float)


def test_response_format_pydantic_and_dict(lm):
    import pydantic

    class Person(pydantic.BaseModel):
        name: str
        age: int

    msgs = [{"role": "user", "content": "Describe a person as JSON."}]
    (out,) = lm(messages=msgs, response_format=Person)
    Person.model_validate_json(out)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    (out,) = lm(messages=msgs, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert isinstance(json.loads(out)["ok"], bool)
    (out,) = lm(messages=msgs, response_format={"type": "json_object"}, max_tokens=20)
    assert out.lstrip().startswith("{")  # an object (cut short here by max_tokens)


def test_lm_contract(lm):
    assert lm.supports_response_schema and "response_format" in lm.supported_params
    assert lm.model == "sgnb/SmolLM2-135M-Instruct"
    outs = lm("Say hi.", n=2, temperature=0.8, max_tokens=8)
    assert len(outs) == 2 and all(isinstance(o, str) for o in outs)
    (out,) = lm("Say hi.", logprobs=True, top_logprobs=2, max_tokens=4)
    tokens = out["logprobs"].content
    assert out["text"] and 1 <= len(tokens) <= 4 and all(len(t.top_logprobs) == 2 for t in tokens)
    usage = lm.history[-1]["usage"]
    assert usage["prompt_tokens"] > 0 and 0 < usage["completion_tokens"] <= 4


def test_calls_go_through_the_engine(lm, engine):
    """A DSPy call is an engine request like any other: it shows in the engine's events, and its prompt is in
    the radix tree afterwards (a repeat hits the cache)."""
    seen = []
    unsubscribe = engine.subscribe(seen.append)
    try:
        with dspy.context(lm=lm, adapter=dspy.JSONAdapter()):
            dspy.Predict(Sum)(a=4, b=5)
    finally:
        unsubscribe()
    assert any(e["type"] == "request" and e.get("state") == "finished" for e in seen)
    assert any(e["type"] == "insert" for e in seen)
    prompt = engine.apply_chat_template(lm.history[-1]["messages"])
    ids = engine.tokenizer.encode(prompt)
    assert engine.tree.prefix_len(ids) >= len(ids) - 1


def test_async(lm):
    import asyncio

    async def run():
        with dspy.context(lm=lm, adapter=dspy.JSONAdapter()):
            return await dspy.Predict(Sum).acall(a=1, b=1)

    assert isinstance(asyncio.run(run()).total, int)


@pytest.fixture(scope="module")
def server(engine):
    from sgnb.server import start_server_thread

    handle = start_server_thread(engine, "127.0.0.1", 0)
    yield handle
    handle.stop()


def test_lm_over_runtime_endpoint(server):
    """Any sgnb backend: here SGLang's native API to `sgnb serve`."""
    import sgnb
    import sgnb.dspy

    remote = sgnb.dspy.LM(sgnb.RuntimeEndpoint(server.url), temperature=0, max_tokens=150)
    with dspy.context(lm=remote, adapter=dspy.JSONAdapter()):
        assert isinstance(dspy.Predict(Sum)(a=2, b=2).total, int)


def test_dspy_litellm_against_sgnb_serve(server, engine):
    """The README's configuration: DSPy's own LM through LiteLLM's lm_studio provider (a generic OpenAI-compatible
    client that LiteLLM counts as supporting response schemas), so JSONAdapter sends the schema and the server
    constrains the reply."""
    pytest.importorskip("litellm")
    remote = dspy.LM(f"lm_studio/{engine.model_name}", api_base=server.url + "/v1", api_key="local",
                     temperature=0, max_tokens=150, cache=False)
    assert remote.supports_response_schema and "response_format" in remote.supported_params
    with dspy.context(lm=remote):  # the default ChatAdapter, falling back to JSON on the 135M model
        assert isinstance(dspy.Predict(Sum)(a=2, b=3).total, int)
        pred = dspy.ChainOfThought(Sentiment)(text="This is awful.")
    assert pred.label in ("positive", "negative")
    with dspy.context(lm=remote, adapter=dspy.JSONAdapter()):
        assert isinstance(dspy.Predict(Sum)(a=7, b=1).total, int)
    assert remote.history[-1]["kwargs"].get("response_format") is not None


def test_dspy_openai_provider_sends_no_schema_for_an_unknown_model(server, engine):
    """Why the README points DSPy at `lm_studio/`: with `openai/<model>` DSPy decides from its bundled model catalog,
    never from the server (nothing /v1/models could advertise changes it), that an unknown model takes no
    response_format, so JSONAdapter sends none and the reply is unconstrained. If this starts failing, DSPy has
    learnt otherwise: the plain `openai/` spelling then works too and the README can say so."""
    plain = dspy.LM(f"openai/{engine.model_name}", api_base=server.url + "/v1", api_key="local")
    assert not plain.supports_response_schema and "response_format" not in plain.supported_params
    remote = dspy.LM(f"lm_studio/{engine.model_name}", api_base=server.url + "/v1", api_key="local")
    assert remote.supports_response_schema and "response_format" in remote.supported_params
