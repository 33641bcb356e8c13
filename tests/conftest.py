"""Shared fixtures: real engines on the default model (the exact fp32 one and the quantized one users get, below)
and the HF transformers oracle on the same weights; the browser tests' chromium and Playwright browser come from
tests/browsers.py."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# No test reaches the Hugging Face hub: huggingface_hub reads this when first imported (hub ids resolve from the
# local cache only; tests/engine/test_hub.py builds its own cache)
os.environ["HF_HUB_OFFLINE"] = "1"

# `make test` runs the suite in pytest-xdist workers: each gets its share of the cores for torch's threads (read when
# torch is imported, just below; an engine on CPU takes OMP_NUM_THREADS too), so that one worker's threads never
# busy-wait on the cores the other works on
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    os.environ.setdefault("OMP_NUM_THREADS",
                          str(max(1, len(os.sched_getaffinity(0)) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))

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


def _interpreter_patches_once() -> None:
    """Triton's interpreter points triton.language's builtins at its numpy versions before every launch, and
    again at every call of a jit function from a kernel (tl.max, tl.sum and tl.cdiv are such functions: once per
    program instance and loop iteration), each time finding them with inspect.getmembers over the language
    modules: 28% of the interpreted decode kernel's time (py-spy, test_decode_matches_refs). Here a launch patches
    them as Triton does (the same (name, builtin) pairs through its own `_patch_attr`, found once per module: a
    module's builtins do not change), and a call from inside a launch whose language modules that launch has
    patched already patches nothing more. Nothing else of the interpreter changes; a Triton without these
    functions is left as it is."""
    import inspect

    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    if not all(callable(getattr(interpreter, f, None)) for f in ("_patch_builtin", "_patch_attr", "_patch_lang")):
        return
    builtins: dict[int, list[tuple[str, object]]] = {}

    def patch_builtin(pkg, builder, scope) -> None:
        members = builtins.get(id(pkg))
        if members is None:  # the first patch of this module: nothing of it is patched yet
            members = builtins[id(pkg)] = [(name, m) for name, m in inspect.getmembers(pkg) if tl.core.is_builtin(m)]
        for name, member in members:
            interpreter._patch_attr(pkg, name, member, builder, scope)

    triton_patch_lang = interpreter._patch_lang
    launch: list[set[int]] = []  # the language modules the launch in progress patched (none: no launch)

    class Patched:  # what a call inside a launch gets back (Triton drops it: the launch restores everything)
        def restore(self) -> None:
            pass

    def patch_lang(fn):
        langs = {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}
        if launch and langs <= launch[0]:
            return Patched()
        scope = triton_patch_lang(fn)
        if launch:  # a call inside the launch that sees a module the launch did not
            launch[0] |= langs
            return scope
        launch.append(langs)  # a launch (GridExecutor): it restores the scope when its grid is done
        restore = scope.restore

        def restore_and_end() -> None:
            launch.clear()
            restore()

        scope.restore = restore_and_end
        return scope

    interpreter._patch_builtin = patch_builtin
    interpreter._patch_lang = patch_lang


if os.environ.get("TRITON_INTERPRET") == "1":
    _interpreter_patches_once()


# the tests that drive JupyterLab / Notebook 7 in chromium: under xdist one unit of work (see pytest_xdist_make_scheduler)
BROWSER_FILES = frozenset({"tests/labextension/test_panel.py", "tests/labextension/test_saved_views.py",
                           "tests/notebooks/test_offline_export.py", "tests/widgets/test_program_view_browser.py",
                           "tests/widgets/test_tree_browser.py", "tests/widgets/test_widgets_browser.py"})


def _unit_of_work(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return "browser" if path in BROWSER_FILES else path


def pytest_xdist_make_scheduler(config, log):
    """`make test` runs `pytest -n 2`: a test file is one unit of work, so its module fixtures (engines, servers, a
    JupyterLab) are made once, in one worker. The browser files are one unit together: two chromiums with their
    JupyterLab servers and kernels side by side on two cores stretch each other's waits and main-thread tasks
    (tests/widgets/test_tree_browser.py asserts no long task over 100 ms). (xdist's own loadgroup cannot say this
    under pytest 9.2: it renames node ids, which pytest now derives.)"""
    from xdist.scheduler import LoadScopeScheduling

    class Scheduler(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit_of_work(nodeid)

    return Scheduler(config, log)


def pytest_collection_modifyitems(config, items):
    """In an xdist worker, the browser unit comes first (with --no-loadscope-reorder, xdist hands out the units in
    collection order), so the other worker takes the rest meanwhile. A plain `pytest` runs as collected."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=lambda item: _unit_of_work(item.nodeid) != "browser")  # stable: the order within kept


def pytest_configure(config):
    """A process started in the background by a shell without job control inherits SIGINT ignored, and Python
    then keeps it ignored: Ctrl-C would not interrupt, and `_sigint_stays_default` would blame the first test.
    The suite runs with Python's own handler, as a terminal gives it."""
    import signal

    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


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


# Two engines on the default model, each made once per worker. A test's `engine` (and `server`, over it) is the
# exact fp32 one, which the HF oracle tests need and whose outputs do not depend on the batch or on what is cached
# (tests that compare two paths token for token or logprob for logprob rely on that). A module whose assertions
# hold for any model sets `ENGINE = "default"` and gets the engine a user gets, quantized as the CPU default is:
# its decode step is ~2x faster (15 vs 29 ms a token at one thread), but a call of more rows than the packed
# kernels take runs the dense weights, so its numbers depend on batching and cache hits. Its cache is flushed as
# each such module starts, so a module sees the same cache whatever ran before it in the worker.
@pytest.fixture(scope="session")
def exact_engine():
    from sgnb.engine import Engine

    eng = Engine("smollm2", quantization="none")  # exact fp32: the HF oracle tests
    yield eng
    eng.shutdown()


@pytest.fixture(scope="session")
def default_engine():
    from sgnb.engine import Engine

    eng = Engine("smollm2")
    yield eng
    eng.shutdown()


def _engine_kind(request) -> str:
    kind = getattr(request.module, "ENGINE", "exact")
    assert kind in ("exact", "default"), f"{request.module.__name__}.ENGINE = {kind!r}: 'exact' or 'default'"
    return kind


@pytest.fixture(scope="module")
def engine(request):
    kind = _engine_kind(request)
    eng = request.getfixturevalue(f"{kind}_engine")
    if kind == "default":
        assert eng.flush_cache(), "the default engine was busy as a module started"
    return eng


def _serve(engine):
    from sgnb.server import start_server_thread

    return start_server_thread(engine, "127.0.0.1", 0)


@pytest.fixture(scope="session")
def exact_server(exact_engine):
    handle = _serve(exact_engine)
    yield handle
    handle.stop()


@pytest.fixture(scope="session")
def default_server(default_engine):
    handle = _serve(default_engine)
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def server(request, engine):
    """`sgnb serve` on loopback (a free port) over the module's `engine` (requested so that the default engine's
    cache is flushed first), for the clients under test (sgnb's RuntimeEndpoint and OpenAI backends, the official
    `openai` client, SGLang's frontend). A module that needs other server options starts its own."""
    return request.getfixturevalue(f"{_engine_kind(request)}_server")


@pytest.fixture(scope="session")
def hf_model(exact_engine):
    """transformers' LlamaForCausalLM (fp32) over the engine's converted weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from sgnb.engine.model_loader import load_state_dict

    cfg = LlamaConfig(**exact_engine.source.config.to_hf_dict())
    cfg._attn_implementation = "eager"
    model = LlamaForCausalLM(cfg).eval()
    missing, unexpected = model.load_state_dict(load_state_dict(exact_engine.source, torch.device("cpu"), torch.float32),
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
