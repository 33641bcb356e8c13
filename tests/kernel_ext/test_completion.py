"""Completion and help: `%sgl` lines complete their subcommands, options and model aliases; in a `%%sgl` cell the
primitives are known to the kernel's completer and inspector (`gen(max_t` + Tab, `gen(` + Shift-Tab). Through a
real kernel (jupyter_client), as JupyterLab asks (the `kernel` fixture: conftest.py); no model is loaded."""

from __future__ import annotations

import inspect

import sgnb
from sgnb.kernel_ext.engine_magics import SUBCOMMANDS, complete_line, model_aliases


def test_subcommands_options_and_model_aliases():
    assert complete_line("%sgl mo", {}) == ("mo", ["model"])
    assert complete_line("%sgl st", {}) == ("st", ["stats", "status"])
    assert complete_line("%sgl ", {}) == ("", [*SUBCOMMANDS, "help"])
    assert complete_line("%sgl model sm", {}) == ("sm", ["smollm2", "SmolLM2-135M-Instruct"])
    fragment, names = complete_line("%sgl model dummy:ti", {})
    assert fragment == "dummy:ti" and "dummy:tiny" in names and all(n.startswith("dummy:ti") for n in names)
    assert "dummy:tiny" in model_aliases()
    assert complete_line("%sgl model --de", {}) == ("--de", ["--device"])
    assert complete_line("%sgl model --schedule-policy ", {})[1] == ["lpm", "dfs-weight", "fcfs"]
    assert complete_line("%sgl model --device cpu sm", {})[1] == ["smollm2", "SmolLM2-135M-Instruct"]
    assert complete_line("%sgl model smollm2 ", {}) == ("", [])  # the model is given
    assert complete_line("%sgl serve --p", {}) == ("--p", ["--port"])
    assert complete_line("x = 1\n%sgl mo".splitlines()[-1], {}) == ("mo", ["model"])
    assert complete_line("%%sgl --te", {}) == ("--te", ["--temperature"])
    assert complete_line("print(1)", {}) is None and complete_line("%sgl", {}) is None


def test_backend_and_state_names_come_from_the_namespace():
    from sgnb.backends.base import Backend
    from sgnb.state import ProgramState

    backend = Backend()
    state = ProgramState.__new__(ProgramState)  # only its type matters here
    ns = {"rt": backend, "chat": state, "n": 3, "_hidden": backend}
    fragment, names = complete_line("%sgl backend ", ns)
    assert names == ["http://127.0.0.1:30000", "openai:", "anthropic:", "rt"]
    assert complete_line("%sgl backend op", ns) == ("op", ["openai:"])
    assert complete_line("%%sgl -o x -i ", ns) == ("", ["chat"])


def test_gen_signature_is_introspectable():
    params = inspect.signature(sgnb.gen).parameters
    assert list(params)[:2] == ["name", "max_tokens"] and "temperature" in params and "regex" in params


def _complete(kc, code: str, cursor: int | None = None) -> tuple[list[str], str]:
    cursor = len(code) if cursor is None else cursor
    content = kc.complete(code, cursor, reply=True, timeout=60)["content"]
    assert content["status"] == "ok", content
    return content["matches"], code[content["cursor_start"]:content["cursor_end"]]


def test_sgl_line_completes_through_the_kernel(kernel):
    assert _complete(kernel, "%sgl mo") == (["model"], "mo")
    assert _complete(kernel, "%sgl model sm") == (["smollm2", "SmolLM2-135M-Instruct"], "sm")
    matches, replaced = _complete(kernel, "%sgl model --de")
    assert matches == ["--device"] and replaced == "--de"
    # in a cell with other lines, with the cursor on the %sgl line
    code = "x = 1\n%sgl tr\nprint(x)"
    assert _complete(kernel, code, code.index(" tr") + 3) == (["tree"], "tr")


def test_gen_keywords_complete_and_its_signature_shows_in_a_sgl_cell(kernel):
    matches, replaced = _complete(kernel, "%%sgl --temperature 0\ns += 'Q: ' + gen(max_t")
    assert "max_tokens=" in matches and replaced == "max_t"
    matches, _ = _complete(kernel, "%%sgl\ns += select('x', cho")
    assert "choices=" in matches

    code = "%%sgl\ns += gen("
    content = kernel.inspect(code, len(code), detail_level=0, reply=True, timeout=60)["content"]
    assert content["status"] == "ok" and content["found"], content
    shown = content["data"]["text/plain"]
    assert "Signature" in shown and "max_tokens" in shown and "Generate text into variable" in shown

    # the names sgnb put in the namespace are hidden from %who, and they are sgnb's own objects
    check = kernel.execute_interactive(
        "import sgnb\nassert gen is sgnb.gen and sgl is sgnb and 'gen' not in get_ipython().run_line_magic('who_ls', '')",
        timeout=60)
    assert check["content"]["status"] == "ok", check["content"]


def test_unload_removes_the_completer_and_the_names(kernel):
    code = ("%unload_ext sgnb\nip = get_ipython()\nassert 'gen' not in ip.user_ns and 'sgl' not in ip.user_ns\n"
            "assert not ip.Completer.custom_matchers\n%load_ext sgnb\nassert ip.user_ns['gen'].__name__ == 'gen'")
    reply = kernel.execute_interactive(code, timeout=60)
    assert reply["content"]["status"] == "ok", reply["content"]
    assert _complete(kernel, "%sgl fl") == (["flush"], "fl")
