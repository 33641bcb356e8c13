"""What the notebook shows for a `%%sgl` cell that does not compile, through a real kernel (jupyter_client, as
JupyterLab sends cells; the `kernel` fixture: conftest.py): the error at the cell's line with a caret, as IPython
shows a SyntaxError in a plain cell, with no frames of IPython or sgnb; the cell does not run. No model is loaded.
(The other user errors of a %%sgl cell: test_magics.py.)"""

from __future__ import annotations

import re

import pytest


def _execute(kc, code: str) -> tuple[dict, str]:
    """Run `code`: (the execute reply's content, what the cell's output area shows as text)."""
    shown: list[str] = []

    def output(msg: dict) -> None:
        kind, content = msg["msg_type"], msg["content"]
        if kind == "error":
            shown.append("\n".join(content["traceback"]))
        elif kind == "stream":
            shown.append(content["text"])

    reply = kc.execute_interactive(code, timeout=60, output_hook=output)
    return reply["content"], re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(shown))


@pytest.mark.parametrize("body, line, error, message", [
    ('s += "Hi"\ns += gen("x", max_tokens=3\ns += "after"\n', 2, "SyntaxError", "'(' was never closed"),
    ("marker = 1\ny = = 2\n", 2, "SyntaxError", "invalid syntax"),
    ('  s += "Hi"\n', 1, "IndentationError", "unexpected indent"),
    ('s += "Hi"\nmarker = 1\nyield marker\n', 3, "SyntaxError", "a %%sgl cell cannot `yield`"),
], ids=["program", "definitions", "indent", "yield"])
def test_a_syntax_error_points_at_the_cells_line(kernel, body, line, error, message):
    reply, shown = _execute(kernel, "%%sgl --temperature 0\n" + body)
    assert reply["status"] == "error" and reply["ename"] == error, reply
    code = body.splitlines()[line - 1]
    # IPython's picture of a SyntaxError: where, the line, a caret, the message; the cell is In [n]
    assert f"File <sgl-cell-{reply['execution_count']}>:{line}" in shown, shown
    assert code.strip() in shown and "^" in shown, shown
    assert shown.rstrip().splitlines()[-1].startswith(f"{error}: {message}"), shown
    assert shown.count(message) == 1, shown
    for noise in ("Traceback", ".py", "interactiveshell", "program_magics", "run_cell_magic", "During handling"):
        assert noise not in shown, (noise, shown)
    # the cell did not run, and the kernel goes on
    after, printed = _execute(kernel, "print('marker' in globals())")
    assert after["status"] == "ok" and printed.strip() == "False", (after, printed)


def test_good_cells_and_completeness_checks_are_left_alone(kernel):
    reply, shown = _execute(kernel, "%%sgl\nvalue = 41 + 1\n")  # a definitions cell: no backend needed
    assert reply["status"] == "ok", (reply, shown)
    reply, printed = _execute(kernel, "print(value)")
    assert printed.strip() == "42"
    # JupyterLab's "is this cell complete?" (the console's Enter) never raises for a body's syntax
    msg_id = kernel.is_complete("%%sgl\nx = = 2\n")
    msg = kernel.get_shell_msg(timeout=30)
    assert msg["parent_header"]["msg_id"] == msg_id and msg["msg_type"] == "is_complete_reply", msg
    assert msg["content"]["status"] in ("complete", "incomplete", "invalid"), msg["content"]


def test_unloading_removes_the_check(kernel):
    code = ("ip = get_ipython()\n"
            "checks = lambda: [t for t in ip.input_transformers_cleanup if type(t).__name__ == 'CellSyntaxCheck']\n"
            "%unload_ext sgnb\nassert checks() == []\n%load_ext sgnb\n%load_ext sgnb\nassert len(checks()) == 1")
    reply, shown = _execute(kernel, code)
    assert reply["status"] == "ok", (reply, shown)
