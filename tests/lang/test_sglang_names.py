"""SGLang's public names, one by one, in `sgnb` (`import sgnb as sgl`): LiteLLM (a real backend, through litellm,
tested here against `sgnb serve` on loopback), Crusoe (the OpenAI backend with Crusoe's defaults), and VertexAI /
ServerArgs (a clear NotImplementedError naming what to use instead)."""

from __future__ import annotations

import sys

import pytest

import sgnb as sgl
from sgnb.backends.base import BackendError

ENGINE = "default"  # its assertions hold for any model: the quantized engine (tests/conftest.py)


def test_every_public_sglang_name_is_in_sgnb():
    sglang = pytest.importorskip("sglang")
    # sglang's submodules (`test` once another test imported sglang.test.test_programs) and its lazy-import helper
    modules = {"lang", "srt", "test", "utils", "version", "LazyImport"}
    missing = [name for name in dir(sglang) if not name.startswith("_") and name not in modules
               and not hasattr(sgl, name)]
    assert missing == []
    assert set(sglang.__all__) <= set(sgl.__all__)


def test_vertexai_and_server_args_say_what_to_use():
    with pytest.raises(NotImplementedError, match=r"sgl\.LiteLLM\('vertex_ai/gemini-pro'\)"):
        sgl.VertexAI("gemini-pro")
    with pytest.raises(NotImplementedError, match="sgnb serve"):
        sgl.ServerArgs(model_path="x")


def test_crusoe_is_openai_with_crusoes_defaults(monkeypatch):
    from sgnb.backends.crusoe import CRUSOE_BASE_URL

    monkeypatch.delenv("CRUSOE_API_KEY", raising=False)
    with pytest.raises(ValueError, match="CRUSOE_API_KEY"):
        sgl.Crusoe("meta-llama/Llama-3.3-70B-Instruct")
    monkeypatch.setenv("CRUSOE_API_KEY", "secret")
    backend = sgl.Crusoe("meta-llama/Llama-3.3-70B-Instruct")
    assert isinstance(backend, sgl.OpenAI) and backend.is_chat_model and not backend.is_openai
    assert str(backend.client.base_url) == CRUSOE_BASE_URL and backend.client.api_key == "secret"
    assert backend.get_server_info()["backend"] == "Crusoe"
    assert str(sgl.Crusoe("m", api_key="k", base_url="http://127.0.0.1:9/v1").client.base_url).startswith(
        "http://127.0.0.1:9/v1")


@pytest.fixture(scope="module")
def server(engine):
    from sgnb.server import start_server_thread

    handle = start_server_thread(engine, "127.0.0.1", 0)
    yield handle
    handle.stop()


@pytest.fixture
def litellm_backend(server, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network at import
    pytest.importorskip("litellm")
    return sgl.LiteLLM("openai/smollm2", base_url=server.url + "/v1", api_key="local", max_retries=0)


@sgl.function
def _chat(s, question):
    s += sgl.system("Answer in one word.")
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=4))


@sgl.function
def _no_roles(s):
    s += "The capital of France is" + sgl.gen("rest", max_tokens=3)


def test_litellm_runs_programs_like_the_openai_backend(litellm_backend, server, engine):
    """Greedy output through LiteLLM equals the OpenAI chat backend's on the same server (same messages, same
    parameters); streaming too; usage is counted."""
    openai = sgl.OpenAI(engine.model_name, base_url=server.url + "/v1", api_key="local", is_chat_model=True)
    via_litellm = _chat.run(question="Is fire hot?", backend=litellm_backend, temperature=0)
    via_openai = _chat.run(question="Is fire hot?", backend=openai, temperature=0)
    assert via_litellm["answer"] == via_openai["answer"] and via_litellm["answer"]
    streamed = _chat.run(question="Is fire hot?", backend=litellm_backend, temperature=0, stream=True)
    assert "".join(streamed.text_iter("answer")) == via_openai["answer"]
    meta = via_litellm.get_meta_info("answer")
    assert meta["completion_tokens"] > 0 and meta["finish_reason"]["type"] in ("stop", "length")
    assert litellm_backend.usage["calls"] == 2 and litellm_backend.usage["prompt_tokens"] > 0
    # a program without roles sends its text as one user message, as SGLang's LiteLLM backend does
    assert _no_roles.run(backend=litellm_backend, temperature=0)["rest"]
    assert litellm_backend.get_server_info()["backend"] == "LiteLLM"


@sgl.function
def _constrained(s):
    s += sgl.user("A digit?") + sgl.assistant(sgl.gen("a", regex="[0-9]"))


def test_litellm_refuses_what_it_cannot_do(litellm_backend):
    with pytest.warns(UserWarning, match="top_k=5 is not a parameter of the LiteLLM API"):  # ignored, and said so
        assert _chat.run(question="x", backend=litellm_backend, top_k=5, use_thread=False)["answer"] is not None
    with pytest.raises(sgl.ProgramError, match="regex .*not available on the LiteLLM API"):
        _constrained.run(backend=litellm_backend).sync()
    with pytest.raises(BackendError, match="logprobs"):
        litellm_backend.select(None, ["a", "b"], 0.0, "token_length_normalized")  # type: ignore[arg-type]
    closed = sgl.LiteLLM("openai/smollm2", base_url="http://127.0.0.1:9/v1", api_key="x", max_retries=0)
    with pytest.raises(sgl.ProgramError, match="chat completion failed"):
        _chat.run(question="x", backend=closed).sync()


def test_litellm_without_litellm_names_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "litellm", None)  # `import litellm` raises ImportError
    with pytest.raises(ImportError, match="pip install litellm"):
        sgl.LiteLLM("openai/x")
