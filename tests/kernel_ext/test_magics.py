"""The IPython extension through IPython's test shell, on the session's engine (tests/conftest.py)."""

from __future__ import annotations

import ctypes
import subprocess
import sys
import threading
import time
import traceback

import pytest
from IPython.core.error import UsageError

import sgnb
from sgnb.kernel_ext import get_session


@pytest.fixture(scope="module")
def ip():
    from IPython.testing.globalipapp import start_ipython

    shell = start_ipython()
    shell.run_line_magic("load_ext", "sgnb")
    yield shell
    shell.run_line_magic("unload_ext", "sgnb")
    sgnb.set_default_backend(None)


@pytest.fixture
def shared(ip, engine):
    """The session engine as the kernel's current backend (each test starts from it, with text displays)."""
    ip.user_ns["shared_runtime"] = runtime = sgnb.Runtime(engine=engine)
    ip.run_line_magic("sgl", "backend shared_runtime")
    get_session(ip).use_widgets = None
    yield runtime
    sgnb.set_default_backend(runtime)


def _idle(engine, timeout: float = 5.0) -> bool:
    """The engine holds no request and no lock (the scheduler may need a moment to leave its queues)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if engine.tree.protected_size == 0 and engine.get_stats()["running"] == 0:
            return True
        time.sleep(0.02)
    return False


def test_load_ext_imports_no_torch():
    code = ("import sys\nfrom IPython.testing.globalipapp import start_ipython\nip = start_ipython()\n"
            "ip.run_line_magic('load_ext', 'sgnb')\nm = ip.magics_manager.magics\n"
            "print('torch' in sys.modules, 'sgl' in m['line'], 'sgl' in m['cell'])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "True", "True"]


def test_help(ip, shared, capsys):
    ip.run_line_magic("sgl", "")
    out = capsys.readouterr().out
    for usage in ("%sgl model [MODEL]", "%sgl backend", "%sgl tree", "%sgl stats", "%sgl flush", "%sgl serve"):
        assert usage in out
    assert "backend: Runtime SmolLM2" in out
    assert "%sgl model" in ip.find_line_magic("sgl").__doc__
    cell_doc = ip.find_cell_magic("sgl").__doc__
    assert "%%sgl [-o NAME]" in cell_doc and "--no-widget" in cell_doc
    ip.run_line_magic("sgl", "model -h")
    assert "--max-total-tokens" in capsys.readouterr().out


@pytest.mark.parametrize("line", ["bogus", "model --no-such-option", "backend", "backend foo:bar",
                                  "backend not_a_backend", "backend http://127.0.0.1:9", "serve --port x",
                                  "tree 3"])
def test_line_usage_errors(ip, shared, line):
    ip.user_ns["not_a_backend"] = 42
    with pytest.raises(UsageError):
        ip.run_line_magic("sgl", line)


def test_cell_usage_errors_and_braces_survive(ip, shared):
    with pytest.raises(UsageError):
        ip.run_cell_magic("sgl", "--no-such-flag", 's += "x"\n')
    ip.user_ns["x"] = 1
    # with variable expansion, `out{x}` would have become the valid name `out1`
    result = ip.run_cell('%%sgl -o out{x}\ns += "x"\n')
    assert isinstance(result.error_in_exec, UsageError)
    assert "out{x}" in str(result.error_in_exec)


def test_views_need_an_in_process_engine(ip, shared):
    class Remote(sgnb.Backend):
        def get_model_name(self) -> str:
            return "remote"

    sgnb.set_default_backend(Remote())
    for line in ("tree", "stats", "serve --port 0"):
        with pytest.raises(UsageError, match="not an in-process engine"):
            ip.run_line_magic("sgl", line)


def test_cell_is_a_program_over_the_user_namespace(ip, shared, capsys):
    ip.user_ns.update(question="What is the capital of France?", SUFFIX="!")
    ip.run_cell_magic("sgl", "--temperature 0 --max-tokens 6 -o qa", """
s += system("You are terse.")
s += user(question)
s += assistant(gen("answer"))
answer = s["answer"] + SUFFIX

def shout(text):
    return text.upper() + SUFFIX
""")
    state = ip.user_ns["qa"]
    assert ip.user_ns["answer"] == state["answer"] + "!"
    assert "What is the capital of France?" in state.text()
    assert state.get_meta_info("answer")["completion_tokens"] <= 6
    ip.user_ns["SUFFIX"] = "?"  # the cell's function reads the user's current value
    assert ip.user_ns["shout"]("hi") == "HI?"
    for name in ("gen", "system", "s", "__sgl_cell__"):
        assert name not in ip.user_ns
    out = capsys.readouterr().out
    assert "answer = " in out  # the text display of a finished program (not in a notebook)


def test_final_expression_is_the_cells_value(ip, shared):
    assert ip.run_cell_magic("sgl", "--max-tokens 2 --no-widget", 's += "x"\ns += gen("y")\ns["y"] == s["y"]\n')
    assert ip.run_cell_magic("sgl", "", "K = 2\nK * 21\n") == 42 and ip.user_ns["K"] == 2
    assert ip.run_cell('%%sgl --no-widget\ns += "x"\n"value"\n').result == "value"
    with pytest.raises(SyntaxError, match="yield"):
        ip.run_cell_magic("sgl", "", 's += "x"\nyield 1\n')


def test_user_names_shadow_primitives(ip, shared):
    ip.user_ns["select"] = "mine"
    try:
        ip.run_cell_magic("sgl", "--no-widget", 's += "x"\npicked = select\n')
        assert ip.user_ns["picked"] == "mine"
    finally:
        del ip.user_ns["select"]


def test_definitions_cell_defines_programs(ip, shared, engine):
    ip.user_ns.pop("_sgl", None)
    ip.run_cell_magic("sgl", "", """
GREETING = "Hello"

@function
def greet(s, name):
    s += user(f"{GREETING}, {name}! Reply with one word.")
    s += assistant(gen("reply", max_tokens=4))
""")
    assert "_sgl" not in ip.user_ns  # nothing ran
    greet = ip.user_ns["greet"]
    assert isinstance(greet, sgnb.SglFunction)
    state = greet.run(name="Ada", temperature=0)
    assert "Hello, Ada!" in state.text() and state["reply"]
    ip.run_cell_magic("sgl", "--max-tokens 3 -o nested", 'greet(s, "Bob")\n')
    assert "Hello, Bob!" in ip.user_ns["nested"].text()


def test_python_error_points_at_the_cell_line(ip, shared):
    with pytest.raises(TypeError, match="max_tokenz") as info:
        ip.run_cell_magic("sgl", "", 's += "hello"\ns += gen("x", max_tokenz=3)\n')
    frames = [f for f in traceback.extract_tb(info.value.__traceback__) if f.filename.startswith("<sgl-cell-")]
    assert frames and frames[0].lineno == 2 and 'gen("x", max_tokenz=3)' in frames[0].line


def test_cell_names_carry_the_cells_in_number(ip, shared):
    """The traceback's `<sgl-cell-N>` is the cell's `In [N]` (IPython counts the cell before running it: it
    read N + 1)."""
    number = ip.execution_count  # what the next stored cell will be shown as: In [number]
    result = ip.run_cell('%%sgl\ns += gen("x", max_tokenz=3)\n', store_history=True)
    frames = [f.filename for f in traceback.extract_tb(result.error_in_exec.__traceback__)
              if f.filename.startswith("<sgl-cell-")]
    assert frames and frames[0].split(".")[0].rstrip(">") == f"<sgl-cell-{number}", frames


def test_program_error_points_at_the_cell_line(ip, shared, capsys):
    body = 's += "hello"\ns += image("cat.png")\ns += gen("x", max_tokens=3)\ns += "after"\n'
    with pytest.raises(sgnb.ProgramError, match="takes no images") as info:
        ip.run_cell_magic("sgl", "", body)
    last = traceback.extract_tb(info.value.__traceback__)[-1]  # the image() line: SmolLM2 takes no images
    assert last.filename.startswith("<sgl-cell-") and last.lineno == 2
    assert last.line == 's += image("cat.png")'
    error = ip.user_ns["_sgl"].error()  # the state is kept, and its error names the line too
    assert f'{last.filename}:2: s += image("cat.png")' in str(error)
    # what a user sees: IPython's traceback shows the cell's line
    result = ip.run_cell("%%sgl\n" + body)
    assert isinstance(result.error_in_exec, sgnb.ProgramError)
    out = capsys.readouterr().out
    assert '----> 2 s += image("cat.png")' in out


def test_stream_without_widget_prints_text(ip, shared, capsys):
    ip.run_cell_magic("sgl", "--stream --no-widget --temperature 0 --max-tokens 8",
                      's += "The alphabet: A, B, C,"\ns += gen("more")\n')
    out = capsys.readouterr().out
    state = ip.user_ns["_sgl"]
    assert out.startswith("The alphabet: A, B, C," + state["more"])
    assert "more = " in out


class _FakeView:
    made: list = []

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs, self.events, self.flushed, self.detached = args, kwargs, [], 0, False
        _FakeView.made.append(self)

    def on_event(self, event):
        self.events.append(event)

    def flush(self):
        self.flushed += 1

    def detach(self):
        self.detached = True


def test_widgets_when_available(ip, shared, engine, monkeypatch):
    import sgnb.widgets

    for name in ("ProgramView", "RadixTreeView", "EngineStats"):
        monkeypatch.setattr(sgnb.widgets, name, type(name, (_FakeView,), {}), raising=False)
    _FakeView.made.clear()
    get_session(ip).use_widgets = True
    ip.run_cell_magic("sgl", "--max-tokens 3", 's += "Hi"\nforks = s.fork(2)\nforks += gen("x")\nforks.join()\n')
    view = _FakeView.made[-1]
    assert type(view).__name__ == "ProgramView" and view.kwargs["title"].startswith("%%sgl")
    kinds = [e["type"] for e in view.events]
    assert kinds[0] == "program_begin" and kinds.count("gen_end") == 2 and "fork" in kinds
    assert view.flushed == 1
    ip.run_cell_magic("sgl", "--max-tokens 3 --no-widget", 's += "Hi"\n')
    assert _FakeView.made[-1] is view
    ip.run_line_magic("sgl", "tree")
    ip.run_line_magic("sgl", "stats")
    tree, stats = _FakeView.made[-2:]
    assert type(tree).__name__ == "RadixTreeView" and tree.args == (engine,)
    assert type(stats).__name__ == "EngineStats" and stats.args == (engine,)
    assert [v for _, v in get_session(ip).views][-2:] == [tree, stats]


def test_text_views_without_widgets(ip, shared, capsys):
    ip.run_cell_magic("sgl", "--max-tokens 2", 's += "Radix trees share prefixes."\ns += gen("x")\n')
    capsys.readouterr()
    ip.run_line_magic("sgl", "tree")
    ip.run_line_magic("sgl", "stats")
    out = capsys.readouterr().out
    assert "radix tree:" in out and "Radix trees share" in out
    assert "cache hit rate" in out and "KV pool" in out


def _interrupt_main_thread_when(engine, running: int) -> threading.Thread:
    """Raise KeyboardInterrupt in the main thread (as the kernel's SIGINT handler would) once `running`
    requests are decoding."""
    main = threading.main_thread().ident

    def fire() -> None:
        deadline = time.monotonic() + 60
        while engine.get_stats()["running"] < running and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(main), ctypes.py_object(KeyboardInterrupt))

    thread = threading.Thread(target=fire, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("body, running, line", [
    ('s += "Count: 1, 2, 3,"\ns += gen("x", max_tokens=4000, ignore_eos=True)\ns += gen("y", max_tokens=9)\n',
     1, ""),
    ('s += "Ideas:"\nforks = s.fork(3)\nforks += gen("idea", max_tokens=4000, ignore_eos=True)\nforks.join()\n',
     3, ""),
    ('s += "Count: 1, 2, 3,"\ns += gen("x", max_tokens=4000, ignore_eos=True)\n', 1, "--stream"),
], ids=["gen", "forks", "stream"])
def test_interrupt_aborts_the_cells_requests(ip, shared, engine, body, running, line, capsys):
    aborted = engine.get_stats()["requests_aborted"]
    thread = _interrupt_main_thread_when(engine, running)
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        ip.run_cell_magic("sgl", line, body)
    thread.join()
    assert time.monotonic() - t0 < 30
    assert _idle(engine), engine.get_stats()
    assert engine.get_stats()["requests_aborted"] - aborted == running
    assert "interrupted" in capsys.readouterr().err
    # the engine serves the next cell
    ip.run_cell_magic("sgl", "--max-tokens 3 --no-widget", 's += "Next:"\ns += gen("z")\n')
    assert ip.user_ns["_sgl"].get_meta_info("z")["completion_tokens"] == 3


def test_flush(ip, shared, engine, capsys):
    ip.run_cell_magic("sgl", "--max-tokens 2 --no-widget", 's += "fill the cache"\ns += gen("x")\n')
    assert engine.tree.total_size > 0
    ip.run_line_magic("sgl", "flush")
    assert "flushed" in capsys.readouterr().out
    assert engine.tree.total_size == 0


def test_serve_shares_the_kernels_engine(ip, shared, engine, capsys):
    ip.run_line_magic("sgl", "serve --port 0")
    server = get_session(ip).server
    try:
        assert server.url in capsys.readouterr().out
        before = engine.get_stats()["requests_finished"]
        ip.run_line_magic("sgl", f"backend {server.url}")
        ip.run_cell_magic("sgl", "--max-tokens 3 --no-widget", 's += "Over HTTP:"\ns += gen("x")\n')
        assert type(sgnb.get_default_backend()).__name__ == "RuntimeEndpoint"
        assert ip.user_ns["_sgl"]["x"]
        assert engine.get_stats()["requests_finished"] > before  # the same engine answered
    finally:
        ip.run_line_magic("sgl", "serve --stop")
    assert not server.running and get_session(ip).server is None


def test_serve_with_an_api_key(ip, shared, engine, capsys):
    import http.client
    import json

    ip.run_line_magic("sgl", "serve --port 0 --api-key k-notebook")
    server = get_session(ip).server
    try:
        out = capsys.readouterr().out
        assert "Content-Type: application/json" in out and "Bearer k-notebook" in out  # the curl line works
        body = json.dumps({"text": "Hi", "sampling_params": {"max_new_tokens": 2}})
        for headers, status in (({}, 401), ({"Authorization": "Bearer k-notebook"}, 200)):
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
            conn.request("POST", "/generate", body=body, headers={"Content-Type": "application/json", **headers})
            assert conn.getresponse().status == status
            conn.close()
        assert sgnb.RuntimeEndpoint(server.url, api_key="k-notebook").get_server_info()
    finally:
        ip.run_line_magic("sgl", "serve --stop")


def test_model_loads_replaces_and_unloads(ip, shared, capsys):
    from sgnb.kernel_ext.session import KernelSession

    line = "model dummy:tiny --device cpu --max-total-tokens 256"
    ip.run_line_magic("sgl", line)
    session = get_session(ip)
    first = session.runtime
    assert sgnb.get_default_backend() is first and first.engine.model_name == "dummy:tiny"
    assert first.engine.runner.kv_pool.size == 256
    assert "loaded in" in capsys.readouterr().out
    ip.run_line_magic("sgl", "serve --port 0")
    server = session.server
    ip.run_line_magic("sgl", line)  # a new engine: the old one, and the server over it, are shut down
    assert not first.engine.is_alive and not server.running and session.server is None
    second = session.runtime
    assert sgnb.get_default_backend() is second and second.engine.is_alive
    # a model that does not exist (or a bad option) leaves the working engine in place
    for bad in ("model nonexistent-model", "model dummy:tiny --device cpu --max-total-tokens 3"):
        with pytest.raises(UsageError, match="the current backend is unchanged"):
            ip.run_line_magic("sgl", bad)
        assert session.runtime is second and second.engine.is_alive and sgnb.get_default_backend() is second
    # a headless run's pinned backend wins over %sgl model
    pinned = KernelSession(ip)
    pinned.pinned = "http://example.invalid:1"
    from sgnb.kernel_ext.engine_magics import EngineMagics

    EngineMagics(ip, pinned).sgl("model smollm2")
    assert "pinned" in capsys.readouterr().out and pinned.runtime is None
    session.close()  # what %unload_ext does: the engine %sgl model loaded is shut down
    assert not second.engine.is_alive and session.runtime is None


def test_model_with_tensor_parallel_workers(ip, shared, capsys):
    """`%sgl model M --tp N` runs the model in N worker processes; replacing the engine stops them."""
    import psutil

    ip.run_line_magic("sgl", "model dummy:tiny --device cpu --tp 2 --max-total-tokens 256")
    session = get_session(ip)
    engine = session.runtime.engine
    assert engine.config.tp_size == 2 and len(engine.runner.worker_pids) == 2
    assert "2 tensor-parallel workers" in capsys.readouterr().out
    ip.run_cell_magic("sgl", "--no-widget -o tp_out", 's += "Hello"\ns += gen("x", max_tokens=3)\n')
    assert engine.get_stats()["generated_tokens"] == 3 and isinstance(ip.user_ns["tp_out"]["x"], str)
    pids = engine.runner.worker_pids
    session.close()
    assert not engine.is_alive and not any(psutil.pid_exists(p) for p in pids)


def test_cell_with_images_and_a_fork(ip, shared, capsys):
    """A %%sgl cell runs on the InterruptibleBackend wrapper: images reach the model through it (the wrapper
    answers for the backend's image token), and a fork's prefix hint carries them."""
    import numpy as np

    ip.run_line_magic("sgl", "model dummy:tiny-llava --device cpu --max-total-tokens 2048")
    session = get_session(ip)
    engine = session.runtime.engine
    ip.user_ns["picture"] = np.full((32, 32, 3), 200, np.uint8)
    ip.run_cell_magic("sgl", "--no-widget --max-tokens 2 -o looked",
                      's += "USER: " + image(picture) + "\\nWhat is it?"\n'
                      'two = s.fork(2)\ntwo += gen("x")\ntwo.join()\n')
    assert len(ip.user_ns["looked"]["x"]) == 2
    media = [m for n in engine.tree_snapshot()["nodes"] for m in n.get("media", [])]
    assert [m["kind"] for m in media] == ["image"]  # the prefix (with its image) computed once, then shared
    ip.run_line_magic("sgl", "tree")  # the text outline labels the image as the views do
    out = capsys.readouterr().out
    assert f"'USER: [image]\\nWhat is it?' (image {media[0]['hash']}, {media[0]['tokens']} tok)" in out, out
    with pytest.raises(sgnb.ProgramError, match="takes no images"):
        ip.run_cell_magic("sgl", "--no-widget --backend shared_runtime", 's += image(picture) + gen("x")\n')
    session.close()
    capsys.readouterr()
