"""The widgets in a real browser (headless Debian chromium through Playwright); screenshots go to test-artifacts/.

1. With no kernel: a notebook that shows a ProgramView, a RadixTreeView and EngineStats over a tiny real program
   is executed by nbclient, exported to HTML by nbconvert (the widget state embedded) and opened. The page loads
   require.js, @jupyter-widgets/html-manager and anywidget from public CDNs; those requests are answered from
   `npm pack` copies, everything else is refused.
2. Live in JupyterLab: a streamed program and a few requests, with a MutationObserver recording what the page
   showed while the cell ran (the span grew token by token, the tree passed through intermediate sizes).
"""

from __future__ import annotations

import json
import mimetypes
import re
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest
from browsers import (
    ARTIFACTS,
    ORIGIN,
    ROOT,
    jupyter_server,
    notebook_failed,
    open_browser,
    run_all_cells,
    shoot,
    write_notebook,
)

pytestmark = pytest.mark.slow

NOTEBOOK = [
    """\
import json, time
import sgnb as sgl
from sgnb.engine import Engine
from sgnb.widgets import EngineStats, ProgramView, RadixTreeView
engine = Engine("smollm2")
runtime = sgl.Runtime(engine=engine)""",
    """\
@sgl.function
def tiny(s):
    s += "A list of colors: red, green," + sgl.gen("more", max_tokens=4, temperature=0)
    s += "\\nThe best one is" + sgl.select("best", choices=[" red", " blue"])

tree = RadixTreeView(engine)
stats = EngineStats(engine)
view = ProgramView(title="tiny")
display(view, tree, stats)
state = view.run(tiny, backend=runtime)
state.sync()
time.sleep(0.3)  # the end event follows the last node
view.flush(); tree.flush(); stats.poll(); tree.detach(); stats.detach()
print(json.dumps({"more": state["more"], "best": state["best"], "nodes": tree.summary["nodes"]}))""",
]


@pytest.fixture(scope="session")
def widget_packages(tmp_path_factory) -> dict[str, Path]:
    """npm packages the exported page loads from CDNs, unpacked: name -> package folder."""
    import anywidget
    from nbconvert import HTMLExporter

    npm = shutil.which("npm")
    assert npm, "the browser test needs npm (to pack the widget manager's JavaScript)"
    manager = HTMLExporter().html_manager_semver_range.replace("*", "latest") or "latest"
    specs = {"@jupyter-widgets/html-manager": manager, "anywidget": f"~{anywidget.__version__}",
             "requirejs": "2.3.7"}
    out = tmp_path_factory.mktemp("npm")
    subprocess.run([npm, "pack", "--silent", *(f"{k}@{v}" for k, v in specs.items())], cwd=out, check=True,
                   capture_output=True)
    packages = {}
    for name in specs:
        (tgz,) = out.glob(name.lstrip("@").replace("/", "-") + "-[0-9]*.tgz")
        dest = out / name.replace("/", "__")
        with tarfile.open(tgz) as t:
            t.extractall(dest, filter="data")
        packages[name] = dest / "package"
    return packages


@pytest.fixture(scope="session")
def exported_notebook(tmp_path_factory) -> tuple[str, dict]:
    """The executed notebook as HTML (nbconvert's lab template) and the values its last cell printed."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nbconvert = pytest.importorskip("nbconvert")
    work = tmp_path_factory.mktemp("notebook")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(src) for src in NOTEBOOK])
    nbclient.NotebookClient(nb, timeout=180, kernel_name="python3",
                            resources={"metadata": {"path": str(work)}}).execute()
    state = nb.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    names = {m["state"].get("_anywidget_id") for m in state.values()}
    assert {"sgnb.widgets._program_view.ProgramView", "sgnb.widgets._radix_tree.RadixTreeView"} <= names
    printed = json.loads(nb.cells[-1].outputs[-1]["text"].strip().splitlines()[-1])
    html, _ = nbconvert.HTMLExporter(template_name="lab").from_notebook_node(nb)
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / "widgets.html").write_text(html, encoding="utf-8")
    return html, printed


CDN = re.compile(r"^https://(?:unpkg\.com|cdn\.jsdelivr\.net/npm)/((?:@[^/@]+/)?[^/@]+)(?:@[^/]*)?(/[^?#]*)?")


def offline(html: str, widget_packages: dict[str, Path], refused: list[str]):
    """A Playwright route handler: the page at ORIGIN + "index.html", the CDN's packages from their npm copies,
    every other request refused (and recorded in `refused`)."""

    def serve(route) -> None:
        url = route.request.url
        if url == ORIGIN + "index.html":
            return route.fulfill(status=200, content_type="text/html", body=html)
        if url.startswith(ORIGIN):  # require.js looks for modules beside the page first, then on the CDN
            return route.fulfill(status=404, body="")
        if "/mathjax/" in url:  # the lab template loads MathJax; nothing here needs it
            return route.fulfill(status=200, content_type="application/javascript", body="")
        if "cdnjs.cloudflare.com/ajax/libs/require.js" in url:
            return route.fulfill(path=str(widget_packages["requirejs"] / "require.js"),
                                 content_type="application/javascript")
        m = CDN.match(url)
        if m and m.group(1) in widget_packages:
            pkg = widget_packages[m.group(1)]
            rel = (m.group(2) or "/").lstrip("/")
            if not rel:
                meta = json.loads((pkg / "package.json").read_text())
                rel = meta.get("module") or meta.get("main") or "index.js"
            f = pkg / rel
            if not f.is_file() and (pkg / (rel + ".js")).is_file():
                f = pkg / (rel + ".js")
            if f.is_file():
                kind = mimetypes.guess_type(f.name)[0] or "application/octet-stream"
                if f.suffix in (".js", ".mjs", ".cjs"):
                    kind = "application/javascript"
                return route.fulfill(path=str(f), content_type=kind, headers={"Access-Control-Allow-Origin": "*"})
        refused.append(url)
        return route.abort()

    return serve


def test_saved_widgets_render_with_no_kernel(chromium, widget_packages, exported_notebook):
    html, printed = exported_notebook
    refused: list[str] = []
    serve = offline(html, widget_packages, refused)

    errors: list[str] = []
    with open_browser(chromium) as browser:
        page = browser.new_page(viewport={"width": 1300, "height": 1000})
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.route("**/*", serve)
        page.goto(ORIGIN + "index.html")

        # the program view: the generated span under its variable, the select with both choices
        page.wait_for_selector(".sgnb-pv-gen[data-var='more']", timeout=60_000)
        assert page.locator(".sgnb-pv-gen[data-var='more']").inner_text() == printed["more"]
        assert page.locator(".sgnb-pv-var").first.inner_text() == "more"
        choices = page.locator(".sgnb-pv-choice")
        assert choices.count() == 2
        chosen = page.locator(".sgnb-pv-choice.chosen").inner_text()
        assert json.dumps(printed["best"]) in chosen and "%" in chosen
        assert page.locator(".sgnb-pv-status.done").count() == 1
        assert "A list of colors" in page.locator(".sgnb-pv-body").first.inner_text()

        # the radix tree: every node drawn (few here), labelled; a click shows the node in the details box
        page.wait_for_selector(".sgnb-rt-node", timeout=30_000)
        nodes = page.locator(".sgnb-rt-node")
        assert nodes.count() == printed["nodes"] >= 3
        labels = page.locator(".sgnb-rt-node text").all_text_contents()
        assert any("A list of colors" in t for t in labels) and "root" in labels
        assert "tokens cached" in page.locator(".sgnb-rt-sum").inner_text()
        label = re.compile(r"^\s*" + re.escape(printed["best"].strip()) + r"\s*$")
        leaf = page.locator(".sgnb-rt-node").filter(has=page.locator("text", has_text=label))
        leaf.click()  # no kernel: the drawing selects on its own and shows the node with the text above it
        details = page.locator(".sgnb-rt-details")
        details.wait_for(state="visible", timeout=5_000)
        assert "1 tok" in details.inner_text() and "A list of colors" in details.inner_text()
        assert page.locator(".sgnb-rt-node.selected").count() == 1

        # the stats: four tiles with their sparklines
        assert page.locator(".sgnb-st-tile").count() == 4
        assert page.locator(".sgnb-st svg polyline").count() >= 4

        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "widgets-page.png"), full_page=True)
        page.locator(".sgnb-pv").first.screenshot(path=str(ARTIFACTS / "widgets-program-view.png"))
        page.locator(".sgnb-rt").first.screenshot(path=str(ARTIFACTS / "widgets-radix-tree.png"))
        page.locator(".sgnb-st").first.screenshot(path=str(ARTIFACTS / "widgets-engine-stats.png"))
    ours = [e for e in errors if "sgnb" in e or "anywidget" in e.lower()]
    assert not ours, ours
    assert not refused, refused


def test_saved_image_notebook_shows_thumbnails_strips_and_chips(chromium, widget_packages):
    """notebooks/image_qa.ipynb executed and exported to HTML, opened with no kernel: the program views show the
    images and the video's frame strip where the programs added them, the tree's image nodes their chips (SVG
    images of data: URLs), and a click on one shows its larger thumbnail in the details box."""
    nbconvert = pytest.importorskip("nbconvert")
    from sgnb.notebook import execute_notebook

    nb = execute_notebook(ROOT / "notebooks" / "image_qa.ipynb", timeout=120)
    html, _ = nbconvert.HTMLExporter(template_name="lab").from_notebook_node(nb)
    refused: list[str] = []
    errors: list[str] = []
    with open_browser(chromium) as browser:
        page = browser.new_page(viewport={"width": 1300, "height": 1000})
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.route("**/*", offline(html, widget_packages, refused))
        page.goto(ORIGIN + "index.html")
        page.wait_for_selector(".sgnb-pv-strip", timeout=60_000)
        page.wait_for_selector(".sgnb-rt-node.media", timeout=30_000)
        drawn = page.evaluate("""() => ({
          images: [...document.querySelectorAll('.sgnb-pv-img')].map(i => [i.naturalWidth, i.src.slice(0, 23)]),
          frames: [...document.querySelectorAll('.sgnb-pv-strip .sgnb-pv-frame')].map(i => i.naturalWidth),
          chips: [...document.querySelectorAll('.sgnb-rt-node.media .sgnb-rt-chip image')]
            .map(i => i.getAttribute('href').slice(0, 23)),
          labels: [...document.querySelectorAll('.sgnb-rt-node.media text')].map(t => t.textContent),
        })""")
        assert len(drawn["images"]) == 2, drawn  # the two pictures of the comparison
        assert all(w > 0 and src == "data:image/jpeg;base64," for w, src in drawn["images"]), drawn
        assert len(drawn["frames"]) >= 4 and all(w > 0 for w in drawn["frames"]), drawn
        # three nodes hold media: the scene (shared by the questions), the night picture, the video
        assert len(drawn["chips"]) == 3 and set(drawn["chips"]) == {"data:image/jpeg;base64,"}, drawn
        assert any("[image]" in t for t in drawn["labels"]) and any("[video]" in t for t in drawn["labels"])
        chip_node = page.locator(".sgnb-rt-node.media").first
        chip_node.click()
        page.wait_for_selector(".sgnb-rt-details .sgnb-rt-media img", timeout=5_000)
        assert "tok" in page.locator(".sgnb-rt-details figcaption").first.inner_text()
        ARTIFACTS.mkdir(exist_ok=True)
        page.locator(".sgnb-rt").first.screenshot(path=str(ARTIFACTS / "widgets-radix-tree-images.png"))
        # the outline ("fit width" in a narrow box, as in the lab panel): the label starts after the chip
        page.set_viewport_size({"width": 640, "height": 1000})
        page.locator(".sgnb-rt-ctl input[name=fit]").first.check()
        page.wait_for_selector(".sgnb-rt[data-layout='outline']", timeout=5_000)
        gap = page.evaluate("""() => [...document.querySelectorAll('.sgnb-rt-node.media')].map(g => {
          const chip = g.querySelector('.sgnb-rt-chip').getBoundingClientRect();
          return g.querySelector('text').getBoundingClientRect().left - chip.right; })""")
        assert gap and all(0 <= x < 12 for x in gap), gap
        page.locator(".sgnb-rt").first.screenshot(path=str(ARTIFACTS / "widgets-radix-tree-images-outline.png"))
        page.locator(".sgnb-pv").nth(1).screenshot(path=str(ARTIFACTS / "widgets-program-view-video.png"))
        page.locator(".sgnb-pv").first.screenshot(path=str(ARTIFACTS / "widgets-program-view-images.png"))
    ours = [e for e in errors if "sgnb" in e or "anywidget" in e.lower()]
    assert not ours, ours
    assert not refused, refused


LIVE_NOTEBOOK = [
    """\
import time
import sgnb as sgl
from sgnb.engine import Engine
from sgnb.widgets import EngineStats, ProgramView, RadixTreeView
engine = Engine("smollm2")
runtime = sgl.Runtime(engine=engine)""",
    """\
@sgl.function
def story(s):
    s += "Once upon a time" + sgl.gen("story", max_tokens=120, temperature=0, ignore_eos=True)

tree = RadixTreeView(engine)
stats = EngineStats(engine, interval=0.25)
display(tree, stats)
state = ProgramView.run(story, backend=runtime, stream=True)
state.sync()
# the story's nodes show as new for 1 s of engine time (highlight_seconds): wait that out, so the endings' hits
# on "Once upon a time" show as hits (within 1 s of its insert a node is new, whatever hits it)
time.sleep(1.5)
for ending in [" there was", " a king", " in a land far away"]:
    engine.generate("Once upon a time" + ending, {"max_new_tokens": 6, "temperature": 0})
    time.sleep(0.3)
time.sleep(0.5)""",
    """\
%load_ext sgnb
%sgl backend runtime""",
    # a %%sgl cell with no flag: its view streams, and its header counts the tokens as they come (120 tokens: long
    # enough for several of the view's updates, which come at <= 20 Hz and slower when a flush takes long)
    """\
%%sgl --temperature 0
s += "A tale:" + gen("tale", max_tokens=120, ignore_eos=True)""",
]


APPS = {"lab": ("jupyterlab", "/lab/tree/live.ipynb?reset"), "notebook7": ("notebook", "/notebooks/live.ipynb")}


@pytest.fixture(params=sorted(APPS))
def jupyter_lab(request, tmp_path):
    """A JupyterLab 4 or Notebook 7 server over tmp_path (no token); yields the notebook's URL."""
    module, path = APPS[request.param]
    write_notebook(tmp_path / "live.ipynb", LIVE_NOTEBOOK)
    with jupyter_server(tmp_path, module, kernels_for=["live.ipynb"]) as url:
        yield url + path


RECORD = """() => {
  window.sgnbSeen = {lengths: [], nodes: [], states: [], tale: [], heads: []};
  new MutationObserver(() => {
    const span = document.querySelector(".sgnb-pv-gen[data-var='story']");
    if (span) window.sgnbSeen.lengths.push(span.textContent.length);
    const tale = document.querySelector(".sgnb-pv-gen[data-var='tale']");
    if (tale) {
      window.sgnbSeen.tale.push(tale.textContent.length);
      const head = tale.closest(".sgnb-pv-root").querySelector(".sgnb-pv-head .sgnb-pv-sum");
      if (head) window.sgnbSeen.heads.push(head.textContent);
    }
    window.sgnbSeen.nodes.push(document.querySelectorAll(".sgnb-rt-node").length);
    for (const n of document.querySelectorAll(".sgnb-rt-node.new, .sgnb-rt-node.hit"))
      window.sgnbSeen.states.push(n.classList.contains("new") ? "new" : "hit");
  }).observe(document.body, {subtree: true, childList: true, characterData: true, attributes: true});
}"""


def test_live_widgets_update_while_the_cell_runs(chromium, jupyter_lab):
    with open_browser(chromium) as browser:
        page = browser.new_page(viewport={"width": 1300, "height": 1000})
        page.goto(jupyter_lab)
        app = "notebook7" if "/notebooks/" in jupyter_lab else "lab"
        page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=90_000)
        page.evaluate(RECORD)
        run_all_cells(page)
        try:
            page.wait_for_selector(".sgnb-pv-gen[data-var='tale']", timeout=180_000)
            page.wait_for_function("document.querySelectorAll('.sgnb-pv-status.done').length >= 2",
                                   timeout=120_000)
        except Exception as e:
            raise notebook_failed(page, f"widgets-live-{app}-failed.png") from e
        page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=60_000)
        seen = page.evaluate("window.sgnbSeen")
        final = page.locator(".sgnb-pv-gen[data-var='story']").inner_text()
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / f"widgets-live-{app}.png"), full_page=True)
    lengths = sorted(set(seen["lengths"]))
    assert len(lengths) >= 5 and lengths[-1] >= len(final.strip()), f"the span grew token by token: {lengths}"
    counts = sorted(set(seen["nodes"]))
    assert len([c for c in counts if c > 1]) >= 3, f"the tree passed through intermediate sizes: {counts}"
    assert {"new", "hit"} <= set(seen["states"])
    # the %%sgl cell streamed by default: several partial texts, and the header's token count moved with them
    tales = sorted(set(seen["tale"]))
    assert len([n for n in tales if n > 0]) >= 4, f"the %%sgl view streamed: {tales}"
    generated = {int(m) for h in seen["heads"] for m in re.findall(r"(\d+) generated", h)}
    assert len(generated) >= 3 and max(generated) == 120, f"the header counted as it went: {sorted(generated)}"


# a reasoning gen (notebooks/reasoning.ipynb's form, sampled, its thinking 120-160 characters: enough tokens to
# stream over several of the view's updates, which come at <= 20 Hz; 20-60 characters streamed in one update in CI)
THINK_NOTEBOOK = [
    """\
import json, time
import sgnb as sgl
from sgnb.engine import Engine
from sgnb.widgets import ProgramView
runtime = sgl.Runtime(engine=Engine("smollm2"))""",
    """\
@sgl.function
def thinker(s):
    s += sgl.user("What is 2 + 3?")
    s += sgl.separate_reasoning(sgl.assistant(sgl.gen(
        "answer", regex=r"<think>[a-z ]{120,160}</think>The answer is [0-9]", max_tokens=250, temperature=0.8)),
        model_type="qwen3")

view = ProgramView(title="thinker")
display(view)
time.sleep(2)  # the view is drawn before the program starts
state = view.run(thinker, backend=runtime, stream=True)
state.sync()
time.sleep(0.3)
view.flush()
print(json.dumps({"answer": state["answer"], "reasoning": state["answer_reasoning_content"]}))""",
]

RECORD_THINK = """() => {
  window.sgnbThink = [];
  new MutationObserver(() => {
    const t = document.querySelector(".sgnb-pv-think .sgnb-pv-think-text");
    const s = document.querySelector(".sgnb-pv-think > summary");
    if (t) window.sgnbThink.push([t.textContent, s ? s.textContent : ""]);
  }).observe(document.body, {subtree: true, childList: true, characterData: true});
}"""


def test_live_reasoning_block_streams_folded_and_unfolds_on_a_click(chromium, tmp_path):
    """In JupyterLab: a gen inside separate_reasoning shows its reasoning as a folded block whose text grows while
    the model thinks ("thinking… N tokens"), then "thought for N tokens, S s" with the answer beside it; a click on
    the block shows the reasoning."""
    write_notebook(tmp_path / "think.ipynb", THINK_NOTEBOOK)
    # settings of its own: no "fetch news?" toast over the view
    with jupyter_server(tmp_path, settings={}, kernels_for=["think.ipynb"]) as url, open_browser(chromium) as browser:
        page = browser.new_page(viewport={"width": 1200, "height": 900})
        page.goto(url + "/lab/tree/think.ipynb?reset")
        page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=90_000)
        page.evaluate(RECORD_THINK)
        run_all_cells(page)
        try:
            page.wait_for_selector(".sgnb-pv-status.done", timeout=180_000)
            page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=60_000)
            page.wait_for_function("document.querySelector('.jp-OutputArea-output pre')?.textContent"
                                   ".includes('reasoning')", timeout=30_000)
        except Exception as e:
            raise notebook_failed(page, "reasoning-live-failed.png") from e
        printed = json.loads([t for t in page.locator(".jp-OutputArea-output pre").all_inner_texts()
                              if '"reasoning"' in t][-1].strip().splitlines()[-1])
        block = page.locator(".sgnb-pv-think")
        assert block.count() == 1 and block.get_attribute("open") is None, "the reasoning starts folded"
        summary = block.locator("summary").inner_text()
        assert re.fullmatch(r"thought for \d+ tokens, \d+\.\d s", summary), summary
        text = block.locator(".sgnb-pv-think-text")
        assert not text.is_visible()
        assert page.locator(".sgnb-pv-gen[data-var='answer']").inner_text() == printed["answer"]
        shoot(page.locator(".sgnb-pv"), "reasoning-folded.png")
        block.locator("summary").click()
        text.wait_for(state="visible", timeout=5_000)
        assert text.inner_text() == printed["reasoning"].strip() or text.text_content() == printed["reasoning"]
        shoot(page.locator(".sgnb-pv"), "reasoning-unfolded.png")
        seen = page.evaluate("window.sgnbThink")
    partial = {t for t, s in seen if s.startswith("thinking") and t}
    assert len(partial) >= 2, f"the reasoning streamed into its block: {sorted(partial)}"
    assert all(printed["reasoning"].startswith(t) for t in partial)
