"""The program view's layout and details in a real browser (headless Debian chromium through Playwright);
screenshots go to test-artifacts/.

1. Real programs on the session's engine (nested forks, a fork(3) with long select choices, a grammar gen with
   logprobs, a run_batch) feed a ProgramView / BatchView; their synced traits are drawn by the widget's own ES
   module, through a stand-in for anywidget's model, into a box as wide as a notebook's output area (800 px, and
   a narrow 480 px). Asserted: no branch column narrower than MIN_COL, nothing past the box's right edge (only
   scroll containers may hold wider content), select chips wrap, one metrics table per program, the token card
   on hover.
2. notebooks/tree_of_thought_fork.ipynb run in JupyterLab: the same layout checks inside the real output area.
"""

from __future__ import annotations

import json
import re
import time

import pytest
from browsers import ORIGIN, ROOT, jupyter_server, run_all_cells, shoot

import sgnb as sgl
from sgnb.widgets import ProgramView
from sgnb.widgets._batch_view import BatchView
from sgnb.widgets._esm import bundle

MIN_COL = 220  # program_view.js: the narrowest a branch column gets

pytestmark = pytest.mark.slow

PAGE = """<!doctype html><html><body style="margin: 0; font-family: sans-serif">
<div id="out" style="width: %dpx; margin: 10px; outline: 1px dashed #c33"></div>
<script type="module">
const state = window.STATE, listeners = {};
const model = { get: (k) => state[k], on: (e, f) => { (listeners[e] ||= []).push(f); }, off() {} };
const url = URL.createObjectURL(new Blob([window.ESM], { type: "text/javascript" }));
const mod = await import(url);
mod.default.render({ model, el: document.getElementById("out") });
window.READY = true;
</script></body></html>"""

# what sticks out past `host` on the right, outside any scroll container (a scroll bar is fine, spilling is not)
OVERFLOW = """(host) => {
  const box = host.getBoundingClientRect(), bad = [];
  for (const e of host.querySelectorAll("*")) {
    if (e.closest(".sgnb-pv-card")) continue;
    let clipped = false;
    for (let a = e.parentElement; a && a !== host; a = a.parentElement) {
      if (["auto", "scroll", "hidden"].includes(getComputedStyle(a).overflowX)) { clipped = true; break; }
    }
    const r = e.getBoundingClientRect();
    if (!clipped && r.width > 0 && r.right > box.right + 1) bad.push(`${e.tagName}.${e.className}: ${r.right - box.right}px`);
  }
  return bad;
}"""

COLUMNS = """(host) => [...host.querySelectorAll(".sgnb-pv-fork > .sgnb-pv-prog")]
  .filter((e) => e.offsetParent !== null).map((e) => e.getBoundingClientRect().width)"""


def show(browser, widget: str, state: dict, width: int):
    """A page with `widget`'s ES module drawing `state` into an output box `width` px wide (#out)."""
    page = browser.new_page(viewport={"width": width + 60, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.add_init_script(f"window.STATE = {json.dumps(state)}; window.ESM = {json.dumps(bundle(widget))};")
    page.route(ORIGIN + "**", lambda r: r.fulfill(status=200, content_type="text/html", body=PAGE % width))
    page.goto(ORIGIN + "index.html")
    try:
        page.wait_for_function("window.READY === true", timeout=10_000)
    except Exception:
        raise AssertionError(f"the widget did not render: {errors}") from None
    page.errors = errors
    return page


def shot(page, name: str) -> None:
    shoot(page.locator("#out"), name)


def traits(view: ProgramView) -> dict:
    return {"title": view.title, "programs": view.programs, "summary": view.summary}


def settled(view: ProgramView) -> dict:
    end = time.monotonic() + 30
    while time.monotonic() < end:
        if not view.flush() and view.programs and all(p["status"] != "running" for p in view.programs):
            return traits(view)
        time.sleep(0.05)
    raise AssertionError("the programs did not finish")


@sgl.function
def tree_of_thought(s):  # notebooks/tree_of_thought_fork.ipynb's program
    s += sgl.system("You are a helpful chess coach. Answer in one short sentence.")
    s += sgl.user("Give one concrete idea for getting better at chess in a month.")
    ideas = s.fork(3)
    ideas += sgl.assistant(sgl.gen("idea", stop="\n"))
    plans = []
    for branch in ideas:
        branch += sgl.user("How would I practise that this week?")
        plans.append(branch.fork(2))
        plans[-1] += sgl.assistant(sgl.gen("plan", stop="\n"))
    for group in plans:
        group.join()
    ideas.join()
    s += sgl.user("Which idea is best? Answer with its number.")
    s += sgl.assistant("The best idea is (" + sgl.select("best", choices=["1", "2", "3"]))


LONG_CHOICES = ["a very long choice, the first, that goes on and on about openings and endgames",
                "another quite long choice that does not fit on one line of a narrow column at all",
                "short", "a fourth one, medium length"]


@sgl.function
def three_ways(s):
    s += "Three ways to learn chess, one per line, each a full sentence.\n"
    forks = s.fork(3)
    for i, f in enumerate(forks):
        f += f"Way {i + 1}:" + sgl.gen("way", max_tokens=20, temperature=0.8)
    forks.join()
    s += "\nThe best of them is:" + sgl.select("best", choices=LONG_CHOICES)


@sgl.function
def detailed(s):
    s += "You are a data clerk. Write a record for a chess player.\nRecord: "
    s += sgl.gen("record", max_tokens=30, temperature=0, regex=r'\{"name": "[a-z]{2,8}", "age": [0-9]{1,2}\}')
    s += "\nA word about chess:" + sgl.gen("word", max_tokens=6, temperature=0.7)


@pytest.fixture(scope="module")
def runtime(engine):
    return sgl.Runtime(engine=engine)


@pytest.fixture(scope="module")
def tot_state(runtime) -> dict:
    view = ProgramView(title="tree of thought")
    view.run(tree_of_thought, backend=runtime, max_new_tokens=24, temperature=0.9)
    return settled(view)


@pytest.fixture(scope="module")
def three_state(runtime) -> dict:
    view = ProgramView(title="three ways")
    view.run(three_ways, backend=runtime)
    return settled(view)


@pytest.fixture(scope="module")
def detail_state(runtime) -> dict:
    view = ProgramView(title="detail")
    view.run(detailed, backend=runtime, return_logprob=True, top_logprobs_num=5, return_text_in_logprobs=True)
    return settled(view)


def assert_fits(page, columns: bool = True) -> None:
    host = page.locator("#out")
    assert host.evaluate(OVERFLOW) == [], "something spills past the output area"
    widths = host.evaluate(COLUMNS)
    assert not columns or widths and min(widths) >= MIN_COL - 0.5, widths


def assert_select_row(table, var: str) -> None:
    """The table's last row is the program's closing select: its variable, its prompt with the cache's share, no
    output or tokens/s (nothing was generated), "select" where a gen says why it stopped."""
    row = table.locator("tr").last
    cells = dict(zip(table.locator("th").all_inner_texts(), row.locator("td").all_inner_texts()))
    assert cells["variable"] == var and cells["finish"] == "select", cells
    assert int(cells["prompt"]) > 0 and 0 <= int(cells["cached"]) <= int(cells["prompt"]), cells
    assert cells["output"] == "" and cells["tok/s"] == "–", cells


@pytest.mark.parametrize("width", [800, 480])
def test_nested_forks_fit_the_output_area(browser, tot_state, width):
    """Three ideas that fork again in two: the outer group (6 columns) shows tabs, the inner ones columns no
    narrower than MIN_COL; one metrics table for the program, its rows one line each; nothing spills."""
    page = show(browser, "program_view.js", tot_state, width)
    try:
        assert_fits(page)
        tabs = page.locator(".sgnb-pv-tab")
        assert tabs.count() == 3 and page.locator(".sgnb-pv-tab.selected").count() == 1
        assert page.locator(".sgnb-pv-group.tabs").count() == 1 and page.locator(".sgnb-pv-fork").count() == 1
        assert re.search(r"branch 1 · idea: \S", tabs.first.inner_text())
        assert page.locator(".sgnb-pv-fork > .sgnb-pv-prog .sgnb-pv-ph").first.inner_text().startswith("branch 1.1")
        tables = page.locator(".sgnb-pv-gens")
        assert tables.count() == 1 and page.locator(".sgnb-pv-group .sgnb-pv-gens").count() == 0
        # the head, each idea and plan, then the closing select (scored, not generated: its own row)
        assert tables.locator("tr").count() == 1 + 3 + 6 + 1
        assert_select_row(tables, "best")
        heights = tables.evaluate("t => [...t.querySelectorAll('td, th')].map(c => c.getBoundingClientRect().height)")
        assert max(heights) < 24, f"a metrics cell wrapped: {max(heights)} px"
        assert set(tables.locator("td.branch").all_inner_texts()) == {"1", "2", "3", "1.1", "1.2", "2.1", "2.2",
                                                                     "3.1", "3.2", "main"}
        height = page.locator(".sgnb-pv").evaluate("e => e.getBoundingClientRect().height")
        assert height < 1400, f"the view is {height} px tall"
        shot(page, f"program-view-tot-{width}.png")

        tabs.nth(1).click()  # the second idea, with its two plans
        page.wait_for_function("document.querySelector('.sgnb-pv-tab.selected').textContent.includes('branch 2')")
        heads = page.locator(".sgnb-pv-fork > .sgnb-pv-prog > .sgnb-pv-ph").all_inner_texts()
        assert [h.split()[1] for h in heads] == ["2.1", "2.2"]
        assert_fits(page)

        page.get_by_role("button", name="side by side").click()  # all six plans: columns that scroll sideways
        page.wait_for_function("!document.querySelector('.sgnb-pv-tab')")
        assert page.locator(".sgnb-pv-group.tabs").count() == 0 and page.locator(".sgnb-pv-fork").count() == 4
        assert_fits(page)
        shot(page, f"program-view-tot-{width}-side-by-side.png")
        page.get_by_role("button", name="tabs").click()
        page.wait_for_selector(".sgnb-pv-group.tabs .sgnb-pv-tab")
        assert not page.errors, page.errors
    finally:
        page.close()


@pytest.mark.parametrize("width", [800, 480])
def test_a_fork_of_three_and_long_choices(browser, three_state, width):
    """fork(3): three columns side by side (the row scrolls when the output is narrower than three), and a
    select's long choices wrap inside the program instead of running off the edge."""
    page = show(browser, "program_view.js", three_state, width)
    try:
        assert_fits(page)
        assert page.locator(".sgnb-pv-tab").count() == 0
        assert len(page.locator("#out").evaluate(COLUMNS)) == 3
        scrolls = page.locator(".sgnb-pv-fork").evaluate("r => r.scrollWidth > r.clientWidth + 1")
        assert scrolls == (width < 3 * MIN_COL + 60)
        box = page.locator(".sgnb-pv-choices")
        chips = box.evaluate("""b => [...b.querySelectorAll('.sgnb-pv-choice')].map(c => {
          const r = c.getBoundingClientRect(); return [r.top, r.right]; })""")
        body = page.locator(".sgnb-pv-body").first.evaluate("b => b.getBoundingClientRect().right")
        assert len(chips) == len(LONG_CHOICES) and all(right <= body + 0.5 for _, right in chips), (chips, body)
        assert len({round(top) for top, _ in chips}) > 1, "the chips wrap onto more than one line"
        assert page.locator(".sgnb-pv-gens tr").count() == 1 + 3 + 1  # the head, each way, the select
        assert_select_row(page.locator(".sgnb-pv-gens"), "best")
        shot(page, f"program-view-fork3-{width}.png")
        assert not page.errors, page.errors
    finally:
        page.close()


def test_token_detail_on_hover(browser, detail_state):
    """Token boundaries, forced vs sampled tokens with a legend, and a card with each token's probability and its
    top alternatives on hover; the cached prompt is shaded where the legend says so."""
    record = next(s for s in detail_state["programs"][0]["segments"] if s.get("var") == "record")
    page = show(browser, "program_view.js", detail_state, 800)
    try:
        assert_fits(page, columns=False)
        legend = page.locator(".sgnb-pv-legend").inner_text()
        assert "forced (grammar / jump-forward)" in legend and "probability" in legend and "sampled" in legend
        assert page.locator(".sgnb-pv-legend input[name=tokens]").is_checked()  # logprobs asked for: shown
        span = page.locator(".sgnb-pv-gen[data-var='record']")
        toks = span.locator(".sgnb-pv-tok")
        assert toks.count() == len(record["tokens"]) and "".join(toks.all_inner_texts()) == record["text"]
        forced = span.locator(".sgnb-pv-tok.forced")
        assert 0 < forced.count() < toks.count()
        colours = forced.evaluate_all("ts => ts.map(t => getComputedStyle(t).backgroundColor)")
        assert len(set(colours)) == 1 and colours[0] not in ("rgba(0, 0, 0, 0)", "transparent")

        card = page.locator(".sgnb-pv-card")
        sampled = span.locator(".sgnb-pv-tok.sampled").first
        sampled.hover()
        card.wait_for(state="visible", timeout=3_000)
        text = card.inner_text()
        assert "sampled · p " in text and "top 5 alternatives" in text, text
        assert card.locator("tr").count() == 5 and card.locator("tr.chosen").count() == 1
        inside = page.locator("#out").evaluate("""h => { const a = h.getBoundingClientRect(),
          b = h.querySelector('.sgnb-pv-card').getBoundingClientRect(); return b.left >= a.left && b.right <= a.right + 1; }""")
        assert inside
        shoot(page, "program-view-token-card.png")  # the card may pass the box
        forced.first.hover()
        page.wait_for_function("document.querySelector('.sgnb-pv-card').textContent.includes('forced')")
        page.mouse.move(0, 0)
        card.wait_for(state="hidden", timeout=3_000)

        page.locator(".sgnb-pv-legend input[name=tokens]").uncheck()  # the switch keeps across redraws
        # the view redraws on the next animation frame: wait for it, then the redrawn switch must stay off
        page.wait_for_function("!document.querySelector('.sgnb-pv-root').classList.contains('show-tokens')",
                               timeout=3_000)
        assert not page.locator(".sgnb-pv-legend input[name=tokens]").is_checked()
        assert not page.errors, page.errors
    finally:
        page.close()


def test_the_cached_prompt_is_shaded(browser, runtime):
    """A second run of the same prompt: the prompt its gen read is shaded as served from the cache."""

    @sgl.function
    def again(s):
        s += "The cache keeps this sentence, which the second run reads again from it. Then: "
        s += sgl.gen("x", max_tokens=3, temperature=0)

    again.run(backend=runtime).sync()
    view = ProgramView()
    view.run(again, backend=runtime)
    page = show(browser, "program_view.js", settled(view), 800)
    try:
        cached = page.locator(".sgnb-pv-cached")
        assert cached.count() >= 1 and "The cache keeps this sentence" in cached.first.inner_text()
        assert "prompt served from the cache" in page.locator(".sgnb-pv-legend").inner_text()
        shade = cached.first.evaluate("e => getComputedStyle(e).backgroundColor")
        assert shade not in ("rgba(0, 0, 0, 0)", "transparent")
    finally:
        page.close()


def test_batch_view_table(browser, runtime, monkeypatch):
    """run_batch in a notebook: the table has a row per program in batch order with its arguments, variables and
    status; a wide value is cut with an ellipsis inside the box, which scrolls rather than spills."""
    import importlib

    import IPython

    from sgnb.widgets import _batch_view

    importlib.import_module("sgnb.function")
    shown: list = []
    monkeypatch.setattr(IPython, "get_ipython", lambda: type("Kernel", (), {"kernel": object()})())
    monkeypatch.setattr(_batch_view, "show", shown.append)
    monkeypatch.setattr(_batch_view.BatchTable, "delay", 0.0)  # the live table, whatever the batch's length

    @sgl.function
    def qa(s, topic):
        s += f"One long sentence about {topic}:" + sgl.gen("sentence", max_tokens=24, temperature=0)
        s += " Is it true?" + sgl.select("true", choices=[" yes", " no"])

    topics = ["openings", "endgames", "tactics " * 12, "time control", "the king's gambit"]
    qa.run_batch([{"topic": t} for t in topics], backend=runtime)
    (view,) = shown
    assert isinstance(view, BatchView)
    state = {"title": view.title, "columns": view.columns, "rows": view.rows, "summary": view.summary}
    page = show(browser, "batch_view.js", state, 480)
    try:
        assert page.locator("#out").evaluate(OVERFLOW) == []
        rows = page.locator(".sgnb-bv tr[data-status]")
        assert rows.count() == len(topics)
        assert rows.locator(".sgnb-bv-status").all_inner_texts() == ["done"] * len(topics)
        assert page.locator(".sgnb-bv th").all_inner_texts()[:5] == ["#", "status", "topic", "sentence", "true"]
        assert "5/5 finished" in page.locator(".sgnb-bv-head").inner_text()
        shot(page, "batch-view.png")
        assert not page.errors, page.errors
    finally:
        page.close()


# ---- in JupyterLab: the example notebook in a real output area -------------------------------------------
@pytest.fixture
def lab_notebook(tmp_path):
    """JupyterLab over a copy of notebooks/tree_of_thought_fork.ipynb (no token); yields its URL."""
    (tmp_path / "tot.ipynb").write_bytes((ROOT / "notebooks" / "tree_of_thought_fork.ipynb").read_bytes())
    with jupyter_server(tmp_path, kernels_for=["tot.ipynb"]) as url:
        yield url + "/lab/tree/tot.ipynb?reset"


def test_tree_of_thought_notebook_in_jupyterlab(browser, lab_notebook):
    page = browser.new_page(viewport={"width": 1100, "height": 1000})
    try:
        page.goto(lab_notebook)
        page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=90_000)
        run_all_cells(page)  # (the first click can land before the notebook panel takes commands)
        try:
            page.wait_for_selector(".sgnb-pv-prog:not(.sgnb-pv-fork .sgnb-pv-prog) > .sgnb-pv-ph .sgnb-pv-status.done",
                                   timeout=180_000)
        except Exception as e:  # say what the notebook showed: it timed out now and then on a starved machine
            shown = page.inner_text(".jp-Notebook")[-3000:]
            raise AssertionError(f"the program did not finish; the notebook shows:\n{shown}") from e
        page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=60_000)
        out = page.locator(".jp-OutputArea-output", has=page.locator(".sgnb-pv")).first
        out.scroll_into_view_if_needed()
        shoot(out, "program-view-tot-jupyterlab.png")
        assert out.evaluate(OVERFLOW) == [], "something spills past the output area"
        assert out.evaluate("o => o.scrollWidth <= o.clientWidth + 1"), "the output area scrolls sideways"
        widths = out.evaluate(COLUMNS)
        assert widths and min(widths) >= MIN_COL - 0.5, widths
        assert out.locator(".sgnb-pv-tab").count() == 3 and out.locator(".sgnb-pv-gens").count() == 1
    finally:
        page.close()
