"""Shared fixtures: one real engine on the default model and the HF transformers oracle on the same weights; the
browser tests' chromium and Playwright browser come from tests/browsers.py."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# No test reaches the Hugging Face hub: huggingface_hub reads this when first imported (hub ids resolve from the
# local cache only; tests/engine/test_hub.py builds its own cache)
os.environ["HF_HUB_OFFLINE"] = "1"

import pytest
import torch

# test helpers that are not tests (tests/llava_fixtures.py, tests/browsers.py) import by name
sys.path.insert(0, str(Path(__file__).parent))
pytest_plugins = ["browsers"]  # the browser tests' fixtures: chromium, browser

# Without a GPU the Triton kernels run in Triton's interpreter (the kernel tests, and the engine with
# attention_backend="triton"). Triton reads this when a kernel is decorated, i.e. when sgnb.kernels' modules
# are first imported, so it is set before any test imports them. The CPU engine's dispatchers still take the
# torch references: only CUDA tensors go to Triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _sigint_stays_default(request):
    """Ctrl-C must always interrupt: a test that leaves another SIGINT handler behind (a library that installs
    one and never restores it) fails here, naming itself, instead of a later interrupt test failing."""
    import signal

    yield
    handler = signal.getsignal(signal.SIGINT)
    if handler is not signal.default_int_handler:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        pytest.fail(f"{request.node.nodeid} left SIGINT handled by {handler!r}")


@pytest.fixture(scope="session")
def engine():
    from sgnb.engine import Engine

    eng = Engine("smollm2", quantization="none")  # exact fp32: the HF oracle tests
    yield eng
    eng.shutdown()


@pytest.fixture(scope="session")
def server(engine):
    """`sgnb serve` on loopback (a free port) over the session's engine, for the clients under test (sgnb's
    RuntimeEndpoint and OpenAI backends, the official `openai` client, SGLang's frontend). A module that needs
    other server options starts its own."""
    from sgnb.server import start_server_thread

    handle = start_server_thread(engine, "127.0.0.1", 0)
    yield handle
    handle.stop()


@pytest.fixture(scope="session")
def hf_model(engine):
    """transformers' LlamaForCausalLM (fp32) over the engine's converted weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from sgnb.engine.model_loader import load_state_dict

    cfg = LlamaConfig(**engine.source.config.to_hf_dict())
    cfg._attn_implementation = "eager"
    model = LlamaForCausalLM(cfg).eval()
    missing, unexpected = model.load_state_dict(load_state_dict(engine.source, torch.device("cpu"), torch.float32),
                                                strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    return model


@pytest.fixture
def hf_logprobs(hf_model):
    """ids -> (len, vocab) float64 log-softmax of HF's logits at every position."""
    import torch

    def run(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = hf_model(torch.tensor([ids])).logits[0]
        return logits.double().log_softmax(-1)

    return run


@pytest.fixture(scope="session")
def mm_engine(tmp_path_factory):
    """An in-process engine on a tiny random LLaVA-NeXT-Video checkpoint (tests/llava_fixtures.py): images and
    videos on the CPU in a second."""
    import llava_fixtures

    from sgnb.engine import Engine

    path = llava_fixtures.make_llava(tmp_path_factory.mktemp("llava-session"), "llava_next_video")
    eng = Engine(str(path), device="cpu")
    yield eng
    eng.shutdown()
