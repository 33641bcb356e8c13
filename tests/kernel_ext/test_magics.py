"""The IPython extension through IPython's test shell, on the session's engine (tests/conftest.py)."""

from __future__ import annotations

import ctypes
import re
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
    from IPython.testing.globalipapp import get_ipython, start_ipython

    shell = start_ipython() or get_ipython()  # the test shell is made once per process
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


def _plain(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def _last_arrow(shown: str) -> str:
    """The code of the last line a traceback points at (`----> N code`)."""
    arrows = [line for line in shown.splitlines() if line.lstrip().startswith("---->")]
    assert arrows, shown
    return arrows[-1].split(maxsplit=2)[2]


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
    for name in ("s", "__sgl_cell__"):  # the cell's own names do not leak
        assert name not in ip.user_ns
    import sgnb

    # the primitives are in the namespace since %load_ext (for completion and Shift-Tab), as the language's own
    assert ip.user_ns["gen"] is sgnb.gen and ip.user_ns["system"] is sgnb.system
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
    with pytest.raises(KeyboardInterrupt, match="interrupted: the cell's requests were aborted") as info:
        ip.run_cell_magic("sgl", line, body)
    thread.join()
    assert time.monotonic() - t0 < 30
    assert _idle(engine), engine.get_stats()
    assert engine.get_stats()["requests_aborted"] - aborted == running
    # what the notebook shows: one short traceback at the cell's line that was running, the message once
    shown = _plain("\n".join(info.value._render_traceback_()))
    assert "state.py" not in shown and "interpreter.py" not in shown and "threading.py" not in shown, shown
    assert shown.count("interrupted") == 1 and shown.count("Traceback") == 1, shown
    assert _last_arrow(shown) in body.splitlines(), shown
    state = ip.user_ns["_sgl"]
    assert state.executor.aborted  # the state reads "interrupted" (not an aborted request's error)
    if "fork" not in body:  # the interrupted gen keeps what it wrote, and says it was aborted
        partial = state["x"]
        assert isinstance(partial, str) and partial and state.text() == "Count: 1, 2, 3," + partial
        meta = state.get_meta_info("x")
        assert meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] >= 1
        assert "y" not in state and isinstance(state.error(), sgnb.ProgramError)
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
    out = capsys.readouterr().out  # what it did, phase by phase, with the time each took
    assert "loaded in" in out and "finding the model" in out and "loading the tokenizer" in out, out
    assert re.search(r"loading the weights.*: \d+\.\d s", out), out
    assert set(first.engine.load_phases) >= {"model", "tokenizer", "weights"}
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


# ---- continuing a conversation across cells ----------------------------------------------------------------
def test_a_chat_continues_across_cells(ip, shared, engine, capsys):
    """`%%sgl -o chat`, then plain `chat += ...` in a later cell, then `%%sgl -i chat`: each turn starts from the
    state's text, so its request hits the radix cache for the whole conversation so far."""
    ip.run_cell_magic("sgl", "--temperature 0 --max-tokens 4 -o chat",
                      's += system("You are terse.")\ns += user("Name a color.")\ns += assistant(gen("a1"))\n')
    chat = ip.user_ns["chat"]
    turn1 = chat.text()
    prompt1 = chat.get_meta_info("a1")["prompt_tokens"]
    cached = engine.get_stats()["cached_tokens"]
    result = ip.run_cell('import sgnb as sgl\nchat += sgl.user("Another one.")\n'
                         'chat += sgl.assistant(sgl.gen("a2", max_tokens=4))\nreply = chat["a2"]\n')
    result.raise_error()
    assert ip.user_ns["reply"] == chat["a2"] and chat.text().startswith(turn1)
    assert chat.get_meta_info("a2")["cached_tokens"] >= prompt1
    assert engine.get_stats()["cached_tokens"] - cached >= prompt1
    prompt2 = chat.get_meta_info("a2")["prompt_tokens"]

    capsys.readouterr()
    ip.run_cell_magic("sgl", "-i chat --max-tokens 3",
                      'same = s is chat\ns += user("And a third.")\ns += assistant(gen("a3"))\n')
    assert ip.user_ns["same"] is True and ip.user_ns["chat"] is chat and ip.user_ns.get("_sgl") is not chat
    assert chat.get_meta_info("a3")["cached_tokens"] >= prompt2
    assert chat.get_meta_info("a3")["completion_tokens"] <= 3  # the cell's own options apply
    roles = [m["role"] for m in chat.messages()]
    assert roles == ["system", "user", "assistant", "user", "assistant", "user", "assistant"]
    assert set(chat.variables()) == {"a1", "a2", "a3"}
    out = capsys.readouterr().out
    assert "Name a color." in out and "And a third." in out  # the transcript shows the whole conversation


def test_a_continued_cell_shows_in_its_own_view(ip, shared, monkeypatch):
    import sgnb.widgets

    monkeypatch.setattr(sgnb.widgets, "ProgramView", type("ProgramView", (_FakeView,), {}), raising=False)
    _FakeView.made.clear()
    get_session(ip).use_widgets = True
    ip.run_cell_magic("sgl", "--max-tokens 2 -o talk", 's += user("Hi")\ns += assistant(gen("a"))\n')
    first = _FakeView.made[-1]
    ip.run_cell_magic("sgl", "--max-tokens 2 -i talk", 's += user("Again")\ns += assistant(gen("b"))\n')
    second = _FakeView.made[-1]
    assert second is not first
    begin = second.events[0]
    assert begin["type"] == "program_begin" and begin["continues"] == first.events[0]["program"]
    assert "Hi" in begin["text"]  # the view gets the text it continues from
    assert not any(e["type"] == "gen_begin" and e["var"] == "b" for e in first.events)  # the old view is left be


def test_a_state_that_cannot_continue_says_so(ip, shared, capsys):
    with pytest.raises(sgnb.ProgramError):
        ip.run_cell_magic("sgl", "--no-widget -o broken", 's += "x"\ns += image("cat.png")\n')
    capsys.readouterr()
    result = ip.run_cell('broken += "more"\n')
    assert isinstance(result.error_in_exec, sgnb.ProgramError)
    out = _plain(capsys.readouterr().out)
    assert "so it cannot continue: re-run the cell or program that made it" in out
    assert _last_arrow(out) == 'broken += "more"' and out.count("Traceback") == 1, out
    assert "state.py" not in out and "interpreter.py" not in out
    for line, match in (("-i broken", "cannot continue"), ("-i no_such_state", "not defined"),
                        ("-i broken", "never uses `s`")):
        body = 'x = 1\n' if "never" in match else 's += "x"\n'
        with pytest.raises(UsageError, match=match):
            ip.run_cell_magic("sgl", line, body)


# ---- one short traceback at the user's line ----------------------------------------------------------------
@pytest.mark.parametrize("line, error, message", [
    ('s += gen("x", regex="(unclosed")', "ValueError", "invalid regex"),
    ('s += gen("x", temperature=-1)', "ValueError", "temperature=-1: must be >= 0"),
    ('s += select("x", choices=[])', "ValueError", "needs a non-empty list of strings"),
    ('s += gen("x", max_tokenz=3)', "TypeError", "unexpected keyword argument 'max_tokenz'"),
    ("s += undefined_thing", "NameError", "name 'undefined_thing' is not defined"),
    ('s += image("cat.png")', "ProgramError", "takes no images"),
    ('s += "word " * 9000 + gen("x", max_tokens=2)', "ProgramError", "context length"),
], ids=["regex", "temperature", "select", "typo", "name", "image", "backend"])
def test_user_errors_show_one_trimmed_traceback(ip, shared, capsys, line, error, message):
    """What the notebook shows for a user error in a %%sgl cell: one traceback whose last frame is the cell's
    line, one message, none of sgnb's frames (nor gen()'s 25-parameter signature, nor the magic's call)."""
    capsys.readouterr()
    result = ip.run_cell(f'%%sgl --no-widget\ns += "Hi"\n{line}\ns += "never"\n')
    assert type(result.error_in_exec).__name__ == error
    out = _plain(capsys.readouterr().out)
    assert out.count("Traceback (most recent call last)") == 1, out
    assert _last_arrow(out) == line, out
    assert out.count(message) == 1, out
    assert out.rstrip().splitlines()[-1].startswith(f"{error}: "), out
    for noise in ("sgnb/", "/engine/", "kernel_ext", "primitives.py", "max_tokens, min_tokens", "run_cell_magic",
                  "skipping hidden"):
        assert noise not in out, (noise, out)


def test_program_errors_read_in_a_plain_cell_show_the_program_line(ip, shared, capsys):
    """`fn.run()` in a plain cell: the error surfaces where the state is read, and the traceback goes on to the
    program line that failed (the line, once: not again in the message)."""
    ip.run_cell('import sgnb as sgl\n@sgl.function\ndef shows(s):\n    s += "x"\n    s += sgl.image("cat.png")\n'
                '    s += sgl.gen("y", max_tokens=2)\n').raise_error()
    capsys.readouterr()
    result = ip.run_cell('st = shows.run()\nst["y"]\n')
    assert isinstance(result.error_in_exec, sgnb.ProgramError)
    out = _plain(capsys.readouterr().out)
    arrows = [line.split(maxsplit=2)[2] for line in out.splitlines() if line.lstrip().startswith("---->")]
    assert arrows == ['st["y"]', 's += sgl.image("cat.png")'], out
    assert out.count("takes no images") == 1 and "(at " not in out, out
    assert "state.py" not in out and "interpreter.py" not in out and "The above exception" not in out
    assert "(at " in str(result.error_in_exec)  # the message itself still names the line (scripts, logs)


def test_an_interrupt_in_a_plain_cell_shows_the_users_line(ip, shared, engine, capsys):
    ip.run_cell('import sgnb as sgl\n@sgl.function\ndef counting(s):\n'
                '    s += "Count:" + sgl.gen("n", max_tokens=4000, ignore_eos=True)\n').raise_error()
    capsys.readouterr()
    thread = _interrupt_main_thread_when(engine, 1)
    result = ip.run_cell('st = counting.run()\nst["n"]\n')
    thread.join()
    assert isinstance(result.error_in_exec, KeyboardInterrupt)
    assert _idle(engine), engine.get_stats()
    out = _plain(capsys.readouterr().out)
    assert _last_arrow(out) == 'st["n"]' and out.count("Traceback") == 1, out
    assert "interrupted: the program and its request were aborted" in out
    assert "state.py" not in out and "threading.py" not in out, out


def test_comments_after_a_magics_arguments_are_ignored(ip, shared, capsys):
    """The README's own lines, pasted as written: `%sgl model smollm2   # the in-process engine ...`."""
    ip.run_line_magic("sgl", "backend shared_runtime   # the in-process engine becomes the default backend")
    assert "default backend is Runtime" in capsys.readouterr().out
    ip.run_cell_magic("sgl", "--max-tokens 2 --no-widget  # a comment, as in Python", 's += "Hi"\ns += gen("x")\n')
    assert ip.user_ns["_sgl"].get_meta_info("x")["completion_tokens"] == 2
    with pytest.raises(UsageError, match="unrecognized arguments: #quoted"):  # a quoted '#' is an argument
        ip.run_line_magic("sgl", "backend shared_runtime '#quoted'")


def test_a_refused_continuation_leaves_no_empty_view(ip, shared, capsys, monkeypatch):
    """A `-i` refused before anything ran took back the (real) view it displayed, which showed "0 programs
    (waiting for a program)" above the error."""
    import sgnb.widgets
    from sgnb.widgets import ProgramView

    made = []

    class Recorded(ProgramView):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    with pytest.raises(sgnb.ProgramError):
        ip.run_cell_magic("sgl", "--no-widget -o broken2", 's += "x"\ns += image("cat.png")\n')
    monkeypatch.setattr(sgnb.widgets, "ProgramView", Recorded)
    get_session(ip).use_widgets = True
    try:
        with pytest.raises(UsageError, match="cannot continue"):
            ip.run_cell_magic("sgl", "-i broken2", 's += "more"\n')
        assert len(made) == 1 and made[0].comm is None  # displayed, then taken back and closed
        with pytest.raises(UsageError, match="contradict"):  # refused before any view is shown
            ip.run_cell_magic("sgl", "--stream --no-stream", 's += "x"\n')
        assert len(made) == 1
    finally:
        get_session(ip).use_widgets = None


def test_a_failed_cells_view_marks_the_spot_and_leaves_the_message_to_the_traceback(ip, shared, monkeypatch):
    """The error was said twice: in full in the view, and in the traceback under it."""
    import sgnb.widgets
    from sgnb.widgets import ProgramView
    from sgnb.widgets._static import program_html

    made = []

    class Recorded(ProgramView):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(sgnb.widgets, "ProgramView", Recorded)
    get_session(ip).use_widgets = True
    try:
        with pytest.raises(sgnb.ProgramError, match="takes no images"):
            ip.run_cell_magic("sgl", "--max-tokens 2", 's += "x" + gen("a")\ns += image("cat.png")\n')
    finally:
        get_session(ip).use_widgets = None
    (view,) = made
    view.flush()
    (prog,) = view.programs
    (err,) = [seg for seg in prog["segments"] if seg["k"] == "error"]
    assert err["below"] and "takes no images" in err["message"]  # kept for the tooltip
    page = program_html(view.title, view.programs, view.summary)
    assert "failed here (BackendError): the traceback is below" in page and "takes no images" not in page


def test_a_failed_cells_state_read_later_shows_no_magic_frame(ip, shared, capsys):
    """Reading a failed %%sgl cell's state in a later plain cell showed the earlier cell's
    `get_ipython().run_cell_magic(...)` frame between the reading line and the program line."""
    with pytest.raises(NameError):
        ip.run_cell_magic("sgl", "--no-widget -o failed", 's += "x"\nfoo = undefined_name\n')
    capsys.readouterr()
    result = ip.run_cell("failed.text()\n")
    assert isinstance(result.error_in_exec, sgnb.ProgramError)
    out = _plain(capsys.readouterr().out)
    assert "run_cell_magic" not in out, out
    arrows = [line.split(maxsplit=2)[2] for line in out.splitlines() if line.lstrip().startswith("---->")]
    assert arrows == ["failed.text()", "foo = undefined_name"], out
