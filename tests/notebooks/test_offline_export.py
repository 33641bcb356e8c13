"""Exports that work with no network: a small notebook (a program, `%sgl tree`, `%sgl stats`) executed with nbclient
on the default model, written as .ipynb (each view's output carries a static text/html snapshot of the final
picture) and as HTML (`sgnb.notebook.export_html`: the views drawn by a script inlined in the page), then opened
in headless Debian chromium with every request that is not a file refused. Also: `sgnb export` and
`jupyter nbconvert --to sgnb.notebook.OfflineHTMLExporter` on the executed notebook, the outputs as the kernel
sends them (what JupyterLab saves: the final snapshot, with no widget state), and the snapshots alone."""

from __future__ import annotations

import html
import json
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from browsers import open_browser, shoot
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from sgnb.export import _page_needs
from sgnb.notebook import WIDGET_VIEW, add_static_views, execute_notebook, export_html, write_notebook
from sgnb.widgets._static import batch_html, program_html, snapshot_html, stats_html, tree_html

NETWORK_SCRIPT = re.compile(r"<script[^>]+src=[\"']https?:")  # what nbconvert's own page loads from CDNs

CELLS = [
    "%load_ext sgnb\n%sgl model smollm2",
    '%%sgl --temperature 0 -o st\ns += "A list of colors: red, green," + gen("more", max_tokens=4)\n'
    's += "\\nThe best one is" + select("best", choices=[" red", " blue"])',
    "%sgl tree",
    "%sgl stats",
    'import json\nprint(json.dumps({"more": st["more"], "best": st["best"]}))',
]


@pytest.fixture(scope="module")
def executed(tmp_path_factory) -> tuple[Path, dict]:
    """The notebook executed and written as out.ipynb and out.html; the values its last cell printed."""
    work = tmp_path_factory.mktemp("offline")
    nb = new_notebook(cells=[new_markdown_cell("# offline export"), *(new_code_cell(c) for c in CELLS)])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, str(work / "small.ipynb"))
    nb = execute_notebook(work / "small.ipynb", timeout=180)
    printed = json.loads(nb.cells[-1].outputs[-1]["text"].strip().splitlines()[-1])
    write_notebook(nb, work / "out.ipynb")
    write_notebook(nb, work / "out.html")
    return work, printed


def _views(nb) -> list[dict]:
    return [o["data"] for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if WIDGET_VIEW in o.get("data", {})]


@pytest.mark.slow
def test_every_view_output_has_a_static_snapshot(executed):
    work, printed = executed
    nb = nbformat.read(str(work / "out.ipynb"), as_version=4)
    views = _views(nb)
    assert len(views) == 3 and all("text/html" in v and "text/plain" in v for v in views)
    program, tree, stats = (v["text/html"] for v in views)
    assert 'data-var="more"' in program and html.escape(printed["more"].strip()) in program
    assert 'data-var="best"' in program and "A list of colors" in program and "done" in program
    assert "radix tree:" in tree and "<b>root</b>" in tree and "A list of colors" in tree
    assert tree.count("<tr>") >= 1 + 4  # the header and the nodes (root, the shared prefix, the branches)
    assert "cache hit rate" in stats and "KV pool" in stats and "SmolLM2" in stats
    # the snapshot is the final picture (from the saved state), not the empty view displayed before the run
    assert "waiting for a program" not in program


# what JupyterLab saves: the outputs as the kernel last sent them, and (by default) no widget state
LIVE_CELLS = [
    "%load_ext sgnb\n%sgl model smollm2",
    '%%sgl --temperature 0 -o st\ns += "A list of colors: red, green," + gen("more", max_tokens=4)',
    '@function\ndef colour(s, n):\n    s += f"Colour number {n}:" + gen("c", max_tokens=3, temperature=0)\n\n'
    'states = colour.run_batch([{"n": 1}, {"n": 2}])',
    'import json\nprint(json.dumps({"more": st["more"], "c": [x["c"] for x in states]}))',
]


@pytest.mark.slow
def test_saved_outputs_carry_the_snapshot_of_the_finished_run(tmp_path):
    """A `%%sgl` cell's view is displayed before its program runs, a run_batch's table once the batch has run
    0.25 s (a shorter batch's when it ends, as its final picture); when the run is over the kernel sends a view's output
    again (update_display_data), so the outputs a frontend saves carry the final snapshot. Executed with nbclient alone (which applies those updates as JupyterLab does), nothing redrawn
    from the widget state afterwards, and the widget state dropped."""
    from nbclient import NotebookClient

    nb = new_notebook(cells=[new_code_cell(c) for c in LIVE_CELLS])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    NotebookClient(nb, timeout=180, kernel_name="python3", extra_arguments=["--IPKernelApp.log_level=ERROR"],
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    nb.metadata.pop("widgets", None)
    nbformat.write(nb, str(tmp_path / "saved.ipynb"))
    nb = nbformat.read(str(tmp_path / "saved.ipynb"), as_version=4)
    printed = json.loads(nb.cells[-1].outputs[-1]["text"].strip().splitlines()[-1])
    # the %%sgl view (a widget) and the run_batch table (a live widget when the batch outlasted 0.25 s, else its
    # static snapshot alone): each output's picture is under text/html
    views = [o["data"] for c in nb.cells if c.cell_type == "code" for o in c.outputs
             if "sgnb-static" in o.get("data", {}).get("text/html", "")]
    assert len(views) == 2 and WIDGET_VIEW in views[0], views
    program, batch = (v["text/html"] for v in views)
    assert "sgnb-static-program" in program and "waiting for a program" not in program
    assert 'data-var="more"' in program and html.escape(printed["more"].strip()) in program
    assert "A list of colors" in program and ">done</b>" in program
    assert "sgnb-static-batch" in batch and "2/2 finished" in batch and batch.count(">done</b>") == 2
    for c in printed["c"]:
        assert f"<code>{html.escape(' '.join(c.split()))}</code>" in batch, (c, batch)


def _open(browser, path: Path, refused: list[str], javascript: bool = True):
    context = browser.new_context(viewport={"width": 1300, "height": 1000}, java_script_enabled=javascript)
    page = context.new_page()

    def route(r) -> None:
        if r.request.url.startswith("file://"):
            return r.continue_()
        refused.append(r.request.url)
        return r.abort()

    page.route("**/*", route)
    page.goto(path.as_uri())
    return page


@pytest.mark.slow
def test_html_export_shows_every_view_with_the_network_blocked(executed, chromium):
    work, printed = executed
    assert not NETWORK_SCRIPT.search((work / "out.html").read_text(encoding="utf-8"))
    refused: list[str] = []
    errors: list[str] = []
    with open_browser(chromium) as browser:
        # scripts on: the live views, drawn from the saved state by the page's own script
        page = _open(browser, work / "out.html", refused)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.wait_for_selector("html[data-sgnb-widgets]", timeout=30_000)
        assert page.locator("html").get_attribute("data-sgnb-widgets") == "3 rendered, 0 static"
        gen = page.locator(".sgnb-pv-gen[data-var='more']")
        assert gen.inner_text().strip() == printed["more"].strip()
        shown = page.locator(".sgnb-pv").first.inner_text()
        assert "A list of colors" in shown and "The best one is" in shown and printed["best"].strip() in shown
        assert page.locator(".sgnb-rt-node").count() >= 4
        labels = page.locator(".sgnb-rt-node text").all_text_contents()
        assert "root" in labels and any("A list of colors" in t for t in labels)
        assert page.locator(".sgnb-st-tile").count() == 4
        assert page.locator(".sgnb-static-output").count() == 0  # each replaced by its view
        page.screenshot(path=str(work / "offline.png"), full_page=True)

        # scripts off (a viewer that runs none): the static snapshots
        page = _open(browser, work / "out.html", refused, javascript=False)
        snapshots = page.locator(".sgnb-static-output")
        assert snapshots.count() == 3
        program, tree, stats = (snapshots.nth(i) for i in range(3))
        assert program.locator("[data-var='more']").inner_text().strip() == printed["more"].strip()
        assert printed["best"].strip() in program.locator("[data-var='best']").inner_text()
        rows = tree.locator("tr").all_inner_texts()
        assert any(r.strip().startswith("root") for r in rows) and any("A list of colors" in r for r in rows)
        assert "cache hit rate" in stats.inner_text() and "KV pool" in stats.inner_text()
        page.screenshot(path=str(work / "offline-static.png"), full_page=True)
    assert not refused, refused
    assert not errors, errors


@pytest.mark.slow
def test_sgnb_export_and_nbconvert_make_the_offline_page(executed):
    work, printed = executed
    r = subprocess.run([sys.executable, "-m", "sgnb.cli", "export", str(work / "out.ipynb"), "-o",
                        str(work / "export.html")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "wrote" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-m", "jupyter", "nbconvert", "--to", "sgnb.notebook.OfflineHTMLExporter",
                        str(work / "out.ipynb"), "--output", "nbconvert"], capture_output=True, text=True,
                       timeout=120, cwd=work)
    assert r.returncode == 0, r.stderr
    for name in ("export.html", "nbconvert.html"):
        page = (work / name).read_text(encoding="utf-8")
        assert "offline_page.js" in page and not NETWORK_SCRIPT.search(page)
        assert page.count('class="sgnb-static-output"') == 3 and html.escape(printed["more"].strip()) in page


# ---- the snapshots and the page, without a kernel ----------------------------------------------------------------
def test_snapshots_escape_text_and_draw_forks_rows_and_tiles():
    gen = {"k": "gen", "var": "a", "text": "<b>bold</b> & more", "done": True,
           "meta": {"prompt_tokens": 5, "cached_tokens": 2, "completion_tokens": 3, "e2e_latency": 0.5,
                    "finish_reason": {"type": "length"}}}
    programs = [
        {"id": "p1", "parent": None, "name": "qa", "status": "done", "elapsed": 1.0, "arguments": {"q": "'x'"},
         "segments": [{"k": "role_begin", "role": "user"}, {"k": "text", "text": "Q: <root>"},
                      {"k": "role_end", "role": "user"}, gen, {"k": "fork", "children": ["p2", "p3"]},
                      {"k": "select", "var": "c", "text": " yes",
                       "choices": [{"text": " yes", "p": 0.75, "chosen": True}, {"text": " no", "p": 0.25}]},
                      {"k": "image", "thumb": "data:image/jpeg;base64,AAAA", "name": "cat.jpg"},
                      {"k": "image", "thumb": "javascript:alert(1)", "name": "bad"}]},
        {"id": "p2", "parent": "p1", "name": "", "status": "done", "segments": [{"k": "text", "text": "left"}]},
        {"id": "p3", "parent": "p1", "name": "", "status": "error",
         "segments": [{"k": "error", "message": "boom <x>", "where": "cell:3"}]},
    ]
    shown = program_html("%%sgl [1]", programs, {"programs": 3, "gens": 1, "prompt_tokens": 5})
    assert "&lt;b&gt;bold&lt;/b&gt; &amp; more" in shown and "Q: &lt;root&gt;" in shown and "<root>" not in shown
    assert "<b>USER</b>" in shown and "<td" in shown and "left" in shown and "boom &lt;x&gt;" in shown
    assert shown.index("left") < shown.index("boom")  # the branches side by side, in order
    assert "&quot; yes&quot; 75%" in shown and "length" in shown and 'src="data:image/jpeg;base64,AAAA"' in shown
    assert "javascript:" not in shown and "[image] bad" in shown
    assert shown.count("<pre") == shown.count("</pre>") and shown.count("<div") == shown.count("</div>")

    rows = [{"id": 0, "parent": None, "text": "", "tokens": 0, "hits": 0},
            {"id": 1, "parent": 0, "text": "A list\nof <colors>", "tokens": 9, "hits": 2, "state": "hit"},
            {"id": 2, "parent": 1, "text": "x" * 200, "tokens": 3, "hits": 0, "locked": True},
            {"id": "g1", "parent": 1, "group": True, "children": 4, "count": 7, "tokens": 30}]
    tree = tree_html(rows, {"nodes": 3, "tokens": 12, "locked": 1, "finished": 2})
    assert "A list\\nof &lt;colors&gt;" in tree and "locked" in tree and "+7 nodes" in tree
    thinking = tree_html([rows[0], {**rows[1], "think": "part"}, {**rows[2], "think": "all"}], {"nodes": 3})
    assert "(part reasoning)</i>" in thinking and "(reasoning)</i>" in thinking and "reasoning" not in tree
    assert "&nbsp;" * 6 + "<code" in tree and "..." in tree and "2 nodes below the root" in tree

    stats = stats_html({"cache_hit_rate": 0.5, "kv_used": 10, "kv_total": 100, "model": "m", "device": "cpu"},
                       {"hit_rate": [0.1, 0.5], "kv_used_frac": [0.1]})
    assert "50%" in stats and "10% used" in stats and "<polyline" in stats and "idle (last 0.0)" in stats


def test_the_batch_snapshot_is_the_table():
    """A run_batch's snapshot (BatchView): the counts, then a row per program with its status, arguments,
    variables and progress, as batch_view.js draws it; text escaped; a failed row's error under its status."""
    rows = [{"i": 0, "program": "p0", "arguments": {"q": "'<b>one</b>'"}, "status": "done",
             "values": {"a": "Paris & Rome"}, "gens": 2, "gens_done": 2, "tokens": 7, "error": "", "elapsed": 1.25},
            {"i": 1, "program": "p1", "arguments": {"q": "'two'"}, "status": "error", "values": {},
             "gens": 1, "gens_done": 0, "tokens": 0, "error": "ValueError: boom <x> " + "y" * 300, "elapsed": 0.5},
            {"i": 2, "program": None, "arguments": {"q": "'three'"}, "status": "queued", "values": {},
             "gens": 0, "gens_done": 0, "tokens": 0, "error": "", "elapsed": None}]
    summary = {"total": 5, "queued": 1, "running": 0, "done": 1, "error": 1, "interrupted": 0, "cancelled": 2,
               "gens": 2, "tokens": 7, "shown": 3, "arguments": 1, "elapsed": 3.0}
    shown = batch_html("qa", ["q", "a"], rows, summary)
    assert "run_batch: qa" in shown and "2/5 finished" in shown and "1 failed" in shown and "2 interrupted" in shown
    assert "2 gens, 7 tokens" in shown and "3.0 s" in shown
    assert shown.count("<tr>") == 1 + 3 and ">q</th>" in shown and ">a</th>" in shown and ">gens</th>" in shown
    assert "&#x27;&lt;b&gt;one&lt;/b&gt;&#x27;" in shown and "<b>one</b>" not in shown
    assert "<code>Paris &amp; Rome</code>" in shown and ">2/2<" in shown and ">1.25<" in shown
    assert ">done</b>" in shown and ">error</b>" in shown and ">queued</b>" in shown
    error = shown.split("<small")[1]  # the error: cut in the cell, whole in its tooltip
    assert "ValueError: boom &lt;x&gt;" in error and "y" * 300 + '"' in error and "...</small>" in error
    assert "y" * 300 + "</small>" not in error
    assert "2 more programs (counted above, not listed)" in shown
    assert shown.count("<div") == shown.count("</div>")
    state = {"_anywidget_id": "sgnb.widgets._batch_view.BatchView", "title": "qa", "columns": ["q", "a"],
             "rows": rows, "summary": summary}
    assert snapshot_html(state) == shown
    assert "0/0 finished" in snapshot_html({"_anywidget_id": "sgnb.widgets._batch_view.BatchView"})


def test_only_sgnb_views_get_a_snapshot():
    state = {"_anywidget_id": "sgnb.widgets._radix_tree.RadixTreeView", "nodes": None, "summary": {}}
    assert "radix tree:" in snapshot_html(state)
    assert snapshot_html({"_anywidget_id": "mypkg.RadixTreeView"}) is None
    assert snapshot_html({"_model_name": "FloatProgressModel"}) is None


def test_a_page_from_saved_state_alone(tmp_path):
    """A notebook whose view was displayed before its program ran: the page and the .ipynb show the saved state."""
    from sgnb.widgets import esm_path

    view = {"version_major": 2, "version_minor": 0, "model_id": "m1"}
    nb = new_notebook(cells=[new_code_cell("%%sgl\n...")])
    nb.cells[0].outputs = [nbformat.v4.new_output("display_data", data={
        WIDGET_VIEW: view, "text/plain": "<ProgramView>", "text/html": "<div>(waiting for a program)</div>"})]
    seg = {"k": "gen", "var": "answer", "text": "forty-two", "done": True, "meta": {}}
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {"version_major": 2, "version_minor": 0,
        "state": {"m1": {"model_name": "AnyModel", "model_module": "anywidget", "model_module_version": "*",
                         "state": {"_anywidget_id": "sgnb.widgets._program_view.ProgramView", "_esm": "export default {}",
                                   "title": "t", "summary": {}, "programs": [
                                       {"id": "p", "parent": None, "status": "done", "segments": [seg]}]}}}}}
    page = export_html(nb)
    assert "forty-two" in page and "waiting for a program" not in page
    assert "waiting for a program" in nb.cells[0].outputs[0]["data"]["text/html"]  # export_html left nb alone
    assert esm_path("offline_page.js").read_text(encoding="utf-8").strip()[:40] in page
    assert add_static_views(nb) == 1 and "forty-two" in nb.cells[0].outputs[0]["data"]["text/html"]
    assert _page_needs(nb) == {"requirejs": False, "mathjax": False}
    nb.cells.append(nbformat.v4.new_markdown_cell("Euler: $e^{i\\pi} = -1$"))
    nb.cells[0].outputs.append(nbformat.v4.new_output("display_data", data={"application/javascript": "1"}))
    assert _page_needs(nb) == {"requirejs": True, "mathjax": True}
    page = write_notebook(nb, tmp_path / "page.html").read_text(encoding="utf-8")
    assert "ajax/libs/require.js" in page and "ajax/libs/mathjax" in page  # what such outputs need, from the CDN


THINK_CELLS = [
    "%load_ext sgnb\n%sgl model smollm2",
    '%%sgl --temperature 0.8 -o chat\ns += user("What is 2 + 2?")\ns += separate_reasoning(\n'
    '    assistant(gen("answer", regex=r"<think>[a-z ]{5,40}</think>The answer is [0-9]", max_tokens=60)),\n'
    '    model_type="qwen3")',
    'import json\nprint(json.dumps({"answer": chat["answer"], "reasoning": chat["answer_reasoning_content"]}))',
]


@pytest.mark.slow
def test_exports_keep_a_gens_reasoning_folded_beside_its_answer(tmp_path, chromium):
    """A reasoning gen's view in the saved notebook and in `export_html`'s page: the static snapshot holds the
    reasoning in a folded <details> ("thought for N tokens") and the answer marked after it; the page's script
    draws the live view's folded block, which a click opens, with the answer beside it."""
    nb = new_notebook(cells=[new_code_cell(c) for c in THINK_CELLS])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, str(tmp_path / "think.ipynb"))
    nb = execute_notebook(tmp_path / "think.ipynb", timeout=180)
    printed = json.loads(nb.cells[-1].outputs[-1]["text"].strip().splitlines()[-1])
    answer, reasoning = printed["answer"], printed["reasoning"]
    assert answer.startswith("The answer is") and len(reasoning) >= 5
    write_notebook(nb, tmp_path / "out.ipynb")
    write_notebook(nb, tmp_path / "out.html")
    (snapshot,) = [v["text/html"] for v in _views(nbformat.read(str(tmp_path / "out.ipynb"), as_version=4))]
    folded = re.search(r'<details data-think="answer"[^>]*><summary[^>]*>thought for (\d+) tokens, \d+\.\d s'
                       r'</summary><pre[^>]*>(.*?)</pre></details>', snapshot, re.S)
    assert folded and int(folded.group(1)) > 0 and folded.group(2) == html.escape(reasoning), snapshot
    marked = re.search(r'data-var="answer">(.*?)</b>', snapshot, re.S)
    assert marked and marked.group(1) == html.escape(answer), "the answer is marked, the thinking is not in it"
    refused: list[str] = []
    with open_browser(chromium) as browser:
        page = _open(browser, tmp_path / "out.html", refused)
        page.wait_for_selector("html[data-sgnb-widgets]", timeout=30_000)
        block = page.locator(".sgnb-pv-think")
        assert block.count() == 1 and block.get_attribute("open") is None
        assert re.fullmatch(r"thought for \d+ tokens, \d+\.\d s", block.locator("summary").inner_text())
        assert page.locator(".sgnb-pv-gen[data-var='answer']").inner_text() == answer
        block.locator("summary").click()
        assert block.locator(".sgnb-pv-think-text").text_content() == reasoning
        shoot(page.locator(".sgnb-pv").first, "reasoning-export.png")

        page = _open(browser, tmp_path / "out.html", refused, javascript=False)  # the snapshot alone
        static = page.locator(".sgnb-static-output details[data-think='answer']")
        assert static.count() == 1 and not static.locator("pre").is_visible()
        static.locator("summary").click()
        assert static.locator("pre").inner_text() == reasoning
        shoot(page.locator(".sgnb-static-output").first, "reasoning-export-static.png")
    assert not refused, refused
