"""The radix tree drawn in a real browser (headless Debian chromium through Playwright), "at a glance".

1. In a bare page: rows that the views build (`sgnb.widgets._tree_rows.build_rows`, through a RadixTreeView and
   the lab panel over real engines, or over synthetic nodes) drawn by radix_tree_draw.js, under JupyterLab's
   own light or dark theme CSS: labels show where siblings differ and chat-template tokens as role chips, a
   500-node tree is an overview that fits, a 5,000-node run_batch tree (the engine's RadixCache) is an overview
   that updates through the widget's own module with no main-thread task over 100 ms of thread time, blank labels show ␣, heat colours after a run, evicted nodes stay visible after an
   eviction, every label is readable in both themes, "follow newest" keeps the root's row in view (pinned).
2. Live in JupyterLab with the dark theme: a RadixTreeView in a notebook starts in "fit width" with the root in
   view, counts the requests done before it was made, and after a run with evictions shows the evicted nodes
   and the heat, readably.
Screenshots go to test-artifacts/.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest
from browsers import ARTIFACTS, ORIGIN, ROOT, jupyter_server, open_browser, run_all_cells, write_notebook

from sgnb.widgets._tree_rows import LABEL_TOKENS, Node, build_rows

LABEL_CHARS = 26  # radix_tree_draw.js: characters of a label in a column box

pytestmark = pytest.mark.slow


def _themes() -> Path:
    import jupyterlab

    for base in (Path(sys.prefix) / "share" / "jupyter" / "lab", Path(jupyterlab.__file__).parent / "static"):
        if (base / "themes" / "@jupyterlab").is_dir():
            return base / "themes" / "@jupyterlab"
    pytest.skip("JupyterLab's theme CSS is not installed")


PAGE = """<!doctype html><html><head><meta charset="utf-8">{link}
<style>body {{ margin: 8px; background: var(--jp-layout-color0, #fff); }}</style></head>
<body><div id="host" style="width: {width}px"></div>
<script type="module">
import {{ drawTree }} from "./radix_tree_draw.js";
window.draw = (state, options) => drawTree(document.getElementById("host"), state, {{}}, options);
window.ready = true;
</script></body></html>"""


class Page:
    """A bare page with radix_tree_draw.js and (optionally) JupyterLab's light or dark theme CSS; nothing else
    can be loaded."""

    def __init__(self, browser, theme: str | None = None, width: int = 900) -> None:
        self.page = browser.new_page(viewport={"width": width + 40, "height": 1000})
        self.errors: list[str] = []
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        html = PAGE.format(link='<link rel="stylesheet" href="theme.css">' if theme else "", width=width)
        css = (_themes() / f"theme-{theme}-extension" / "index.css").read_text() if theme else ""
        draw = (ROOT / "widgets" / "radix_tree_draw.js").read_text()

        def serve(route) -> None:
            url = route.request.url
            if url == ORIGIN + "index.html":
                return route.fulfill(status=200, content_type="text/html", body=html)
            if url == ORIGIN + "radix_tree_draw.js":
                return route.fulfill(status=200, content_type="application/javascript", body=draw)
            if url == ORIGIN + "theme.css" and css:
                return route.fulfill(status=200, content_type="text/css", body=css)
            return route.abort()

        self.page.route("**/*", serve)
        self.page.goto(ORIGIN + "index.html")
        self.page.wait_for_function("window.ready === true")

    def draw(self, rows: list[dict], summary: dict, **options) -> None:
        self.page.evaluate("([s, o]) => { window.draw(s, o); }", [{"nodes": rows, "summary": summary}, options])
        self.page.wait_for_function("document.querySelectorAll('.sgnb-rt-node').length > 0")
        self.page.wait_for_timeout(100)  # the frame after the call

    def close(self) -> None:
        self.page.close()


# every drawn node: its class, label, the box's and the label's computed colours
COLOURS = """() => [...document.querySelectorAll('.sgnb-rt-node')].map(g => {
  const box = getComputedStyle(g.querySelector('rect.box'));
  const text = getComputedStyle(g.querySelector('text.main'));
  return { cls: g.getAttribute('class'), label: g.querySelector('text.main').textContent, box: box.fill,
           boxOpacity: box.fillOpacity, text: text.fill, opacity: getComputedStyle(g).opacity };
})"""

BACKGROUND = "() => getComputedStyle(document.querySelector('.sgnb-rt-scroll')).backgroundColor"


def _rgba(css: str) -> tuple[float, float, float, float]:
    """A computed CSS colour (rgb(), rgba() or color(srgb ...), as Chromium writes color-mix) as 0..1 floats."""
    m = re.match(r"rgba?\(([\d.]+),\s*([\d.]+),\s*([\d.]+)(?:,\s*([\d.]+))?\)", css)
    if m:
        r, g, b = (float(x) / 255 for x in m.groups()[:3])
        return r, g, b, float(m.group(4) or 1)
    m = re.match(r"color\(srgb ([\d.e-]+) ([\d.e-]+) ([\d.e-]+)(?: / ([\d.]+))?\)", css)
    assert m, f"unexpected colour {css!r}"
    return float(m.group(1)), float(m.group(2)), float(m.group(3)), float(m.group(4) or 1)


def _over(top: tuple[float, ...], under: tuple[float, ...]) -> tuple[float, float, float]:
    a = top[3]
    return tuple(top[k] * a + under[k] * (1 - a) for k in range(3))  # type: ignore[return-value]


def _luminance(c: tuple[float, ...]) -> float:
    lin = [x / 12.92 if x <= 0.04045 else ((x + 0.055) / 1.055) ** 2.4 for x in c[:3]]
    return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]


def _contrast(a: tuple[float, ...], b: tuple[float, ...]) -> float:
    la, lb = sorted((_luminance(a), _luminance(b)), reverse=True)
    return (la + 0.05) / (lb + 0.05)


def _readability(page: Page) -> list[dict]:
    """Each drawn node with its box colour (over the page background) and its label's contrast against it."""
    bg = _rgba(page.page.evaluate(BACKGROUND))
    out = []
    for n in page.page.evaluate(COLOURS):
        box = _rgba(n["box"])
        box = (*box[:3], box[3] * float(n["boxOpacity"]))
        fill = _over(box, bg)
        text = _over(_rgba(n["text"]), fill)
        out.append({**n, "fill": fill, "contrast": _contrast(text, fill), "luminance": _luminance(fill)})
    return out


# ---- 1. rows from the views, drawn in a bare page ----------------------------------------------------------
STORY = (" The quick brown fox jumps over the lazy dog near the quiet river bank, while the old farmer counts"
         " his sheep one by one")


def test_labels_show_where_siblings_differ_and_roles_as_chips(engine, chromium):
    """Two prompts with the same text but different tokens at the start of the part they do not share (a
    re-tokenized reply reads like the generated one): siblings whose labels share ~120 characters. Each box
    shows the words after that ("cats" / "dogs"), not the shared start cut by an ellipsis; a chat prompt's
    template tokens are role chips, and the text after them stays in the box."""
    from sgnb.widgets import RadixTreeView

    tok = engine.tokenizer
    engine.flush_cache()
    view = RadixTreeView(engine)
    head = tok.encode("Story:")
    cats = tok.encode("Story:" + STORY + " and the cats sleep.")
    dogs = head + tok.encode(" T") + tok.encode("he" + STORY[4:] + " and the dogs bark.")
    assert tok.decode(dogs).replace("dogs bark", "cats sleep") == tok.decode(cats)  # the same text...
    assert cats[len(head)] != dogs[len(head)]  # ...but not the same first token: siblings in the tree
    chat = engine.apply_chat_template([{"role": "system", "content": "You are terse."},
                                       {"role": "user", "content": "Say hi."}])
    engine.generate(input_ids=[cats, dogs], sampling_params={"max_new_tokens": 1, "temperature": 0})
    engine.generate(chat, {"max_new_tokens": 2, "temperature": 0})
    view.flush()
    view.detach()
    rows = view.nodes
    (cat,) = [r for r in rows if "cats sleep" in r["text"]]
    (dog,) = [r for r in rows if "dogs bark" in r["text"]]
    assert cat["parent"] == dog["parent"] and cat["tokens"] > LABEL_TOKENS  # decoded past the label's tokens
    assert cat["diff"] > 100 and dog["diff"] > 100  # where they part: far beyond what a box shows
    (system,) = [r for r in rows if "You are terse." in r["text"]]
    assert system["label"].startswith("\ue000You are terse.")  # <|im_start|>system\n: one glyph

    ARTIFACTS.mkdir(exist_ok=True)
    with open_browser(chromium) as browser:
        for fit, width in ((False, 1300), (True, 520)):  # columns; the outline of a narrow box
            page = Page(browser, "light", width)
            try:
                page.draw(rows, view.summary, fit=fit)
                drawn = page.page.evaluate("""() => [...document.querySelectorAll('.sgnb-rt-node')].map(g =>
                  ({ label: g.querySelector('text.main').textContent, title: g.querySelector('title').textContent,
                     roles: [...g.querySelectorAll('tspan.role')].map(t => t.getAttribute('class')) }))""")
                (c,) = [d for d in drawn if "cats sleep" in d["title"]]
                (d,) = [d for d in drawn if "dogs bark" in d["title"]]
                assert "cats" in c["label"] and "dogs" in d["label"], (c, d)
                assert c["label"].startswith("…") and d["label"].startswith("…")
                assert "The quick" not in c["label"]  # the shared start gave way to the part that differs
                (s,) = [d for d in drawn if "You are terse." in d["title"]]
                assert s["roles"][:1] == ["role system"] and "role user" in s["roles"], s
                assert "You are terse." in s["label"] and "<|im_start|>" not in s["label"]
                page.page.locator(".sgnb-rt").screenshot(
                    path=str(ARTIFACTS / f"tree-labels-{'outline' if fit else 'columns'}.png"))
                assert not page.errors, page.errors
            finally:
                page.close()


def test_reasoning_reads_apart_from_the_answer(engine, chromium):
    """Three replies that think alike at first (a reasoning model's <think> block in the prompts, on the
    default model): the think markers are chips, the reasoning text is drawn in its own style (tspan.think) up
    to the closing chip, the answer after it plainly; a node wholly inside the block is all reasoning."""
    from sgnb.widgets import RadixTreeView

    engine.flush_cache()
    view = RadixTreeView(engine)
    base = engine.apply_chat_template([{"role": "user", "content": "Apples or pears?"}])
    base += "<think>the user asks about fruit and I"
    replies = [" like apples</think>The answer is apples.", " like pears</think>The answer is pears.",
               " dislike them</think>Neither."]
    engine.generate([base + r for r in replies], {"max_new_tokens": 1, "temperature": 0})
    view.flush()
    view.detach()
    rows = view.nodes
    (like,) = [r for r in rows if r["text"].strip() == "like"]
    assert like["think"] == "all" and like["think_inside"]
    (apples,) = [r for r in rows if "apples." in r["text"]]
    assert apples["think"] == "part" and apples["think_inside"] and apples["parent"] == like["id"]
    with open_browser(chromium) as browser:
        page = Page(browser, "light", 1300)
        try:
            page.draw(rows, view.summary)
            drawn = page.page.evaluate("""() => [...document.querySelectorAll('.sgnb-rt-node')].map(g =>
              ({ title: g.querySelector('title').textContent, cls: g.getAttribute('class'),
                 think: [...g.querySelectorAll('tspan.think')].map(t => t.textContent.trim()),
                 chips: [...g.querySelectorAll('tspan.role')].map(t => t.getAttribute('class')),
                 style: [...g.querySelectorAll('tspan.think')].map(t => getComputedStyle(t).fontStyle) }))""")
            (a,) = [d for d in drawn if "apples." in d["title"]]
            assert a["think"] == ["apples"] and "role think_end" in a["chips"] and "think-part" in a["cls"], a
            assert set(a["style"]) == {"italic"}
            (w,) = [d for d in drawn if d["title"].startswith(" like\n")]
            assert w["think"] == ["like"] and "think-all" in w["cls"], w
            # the prompt's node opens the block past its label (the system prompt fills that): marked all the same
            (top,) = [d for d in drawn if "think-" in d["cls"] and not d["think"]]
            assert "think-part" in top["cls"] and "You are" in top["title"], top
            page.page.locator(".sgnb-rt").screenshot(path=str(ARTIFACTS / "tree-reasoning.png"))
            assert not page.errors, page.errors
        finally:
            page.close()


def _big_tree() -> tuple[list[Node], dict[int, str]]:
    """512 nodes: a system prompt (hit by every request), 480 one-leaf topics and 10 topics asked twice."""
    nodes = [Node(0, None, 0), Node(1, 0, 30, hits=500)]
    texts = {1: "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nOne fact about"}
    nid = 2
    for i in range(480):
        nodes.append(Node(nid, 1, 12))
        texts[nid] = f" topic {i}.<|im_end|>\n<|im_start|>assistant\nFact {i} is"
        nid += 1
    for i in range(10):
        parent = nid
        nodes.append(Node(parent, 1, 6, hits=1))
        texts[parent] = f" theme {i}.<|im_end|>\n"
        nid += 1
        for j in range(2):
            nodes.append(Node(nid, parent, 9))
            texts[nid] = f"<|im_start|>assistant\nAnswer {j} on theme {i}"
            nid += 1
    return nodes, texts


def test_a_500_node_tree_is_an_overview_that_fits(chromium):
    """A 512-node tree, more than the default budget (300 rows): an overview, at most BREADTH (12) children a
    node: the ten other branches whole, two examples of the 480 identical leaves and one "+478 more leaves like
    these" group; it fits the box's width with the root in view, and "zoom to fit" shows all of it."""
    nodes, texts = _big_tree()
    rows, summary = build_rows(nodes, lambda i, n: (texts.get(i, ""), []))
    assert summary["nodes"] == 512 and len(rows) < 60  # an overview, not 299 identical leaves
    (group,) = [r for r in rows if r.get("group")]
    assert (group["children"], group["leaves"], group["shapes"], group["like_shown"]) == (478, 478, 1, True)
    assert len([r for r in rows if r["parent"] == 1 and not r.get("group")]) == 2 + 10

    with open_browser(chromium) as browser:
        page = Page(browser, "light", 700)
        try:
            page.draw(rows, summary, fit=True)
            geo = page.page.evaluate("""() => {
              const scroll = document.querySelector('.sgnb-rt-scroll');
              const box = scroll.getBoundingClientRect();
              const root = document.querySelector('.sgnb-rt-node.root').getBoundingClientRect();
              return { drawn: document.querySelectorAll('.sgnb-rt-node').length, scrollW: scroll.scrollWidth,
                       clientW: scroll.clientWidth, rootIn: root.top >= box.top && root.left >= box.left
                         && root.bottom <= box.bottom && root.right <= box.right + 1,
                       groups: [...document.querySelectorAll('.sgnb-rt-node.group text.main')].map(t => t.textContent),
                       sum: document.querySelector('.sgnb-rt-sum').textContent };
            }""")
            assert geo["drawn"] == len(rows) and geo["scrollW"] <= geo["clientW"], geo
            assert geo["rootIn"] and geo["groups"] == ["+478 more leaves like these"], geo
            assert "511 nodes below the root" in geo["sum"] and "+1 groups" in geo["sum"]
            ARTIFACTS.mkdir(exist_ok=True)
            page.page.locator(".sgnb-rt").screenshot(path=str(ARTIFACTS / "tree-500-overview.png"))
            page.page.locator(".sgnb-rt-ctl input[name=zoom]").check()
            page.page.wait_for_function("Number(document.querySelector('.sgnb-rt').dataset.zoom) < 1")
            zoomed = page.page.evaluate("""() => { const s = document.querySelector('.sgnb-rt-scroll');
              return { zoom: Number(document.querySelector('.sgnb-rt').dataset.zoom), scrollH: s.scrollHeight,
                       clientH: s.clientHeight, scrollW: s.scrollWidth, clientW: s.clientWidth }; }""")
            assert zoomed["scrollH"] <= zoomed["clientH"] + 1 and zoomed["scrollW"] <= zoomed["clientW"], zoomed
            page.page.locator(".sgnb-rt").screenshot(path=str(ARTIFACTS / "tree-500-zoomed.png"))
            assert not page.errors, page.errors
        finally:
            page.close()


# the RadixTreeView's own ES module (radix_tree.js with radix_tree_draw.js inlined) over a stand-in for anywidget's
# model; `deliver(text)` is a kernel message: parsed and applied in a task of its own (as the widget manager handles
# a comm message), then drawn on the next frame. Every main-thread task over 50 ms is recorded (the long-task API).
WIDGET_PAGE = """<!doctype html><html><head><meta charset="utf-8"></head><body style="margin: 8px">
<div id="out" style="width: %dpx"></div>
<script type="module">
const listeners = {};
window.STATE = { nodes: [], summary: {}, collapsed: [], expanded: [], selected: null, details: {} };
const model = { get: (k) => window.STATE[k], set: (k, v) => { window.STATE[k] = v; }, save_changes() {},
                on: (e, f) => { (listeners[e] ||= []).push(f); }, off() {} };
window.LONG = [];
new PerformanceObserver((list) => {
  for (const e of list.getEntries()) window.LONG.push([Math.round(e.startTime), Math.round(e.duration)]);
}).observe({ type: "longtask" });
window.DELIVERED = 0;
window.deliver = (text) => setTimeout(() => {
  const msg = JSON.parse(text);
  for (const [k, v] of Object.entries(msg)) {
    window.STATE[k] = v;
    for (const f of listeners[`change:${k}`] || []) f();
  }
  window.DELIVERED += 1;
}, 0);
window.busy = (ms) => setTimeout(() => { const end = performance.now() + ms; while (performance.now() < end); }, 0);
const url = URL.createObjectURL(new Blob([window.ESM], { type: "text/javascript" }));
const mod = await import(url);
mod.default.render({ model, el: document.getElementById("out") });
window.READY = true;
</script></body></html>"""


def _main_thread_tasks(trace: bytes, mark: str) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """The renderer main thread's tasks in a chromium trace (devtools.timeline categories) as (wall ms, thread ms),
    those before and those after the page's `console.timeStamp(mark)`. A task's thread time is the CPU time the
    main thread spent in it, which waiting for a core does not add to."""
    import json

    events = json.loads(trace)["traceEvents"]
    main = {(e["pid"], e["tid"]) for e in events
            if e.get("ph") == "M" and e.get("name") == "thread_name" and e["args"].get("name") == "CrRendererMain"}
    at = [e["ts"] for e in events if e.get("name") == "TimeStamp" and e.get("args", {}).get("data", {}).get("message") == mark]
    tasks = [e for e in events if e.get("name") == "RunTask" and e.get("ph") == "X" and (e["pid"], e["tid"]) in main]
    assert at and tasks and all("tdur" in e for e in tasks), f"no main-thread tasks with thread times, or no {mark!r}"
    split = [(e["ts"] >= at[0], (e["dur"] / 1000, e["tdur"] / 1000)) for e in sorted(tasks, key=lambda e: e["ts"])]
    return [t for after, t in split if not after], [t for after, t in split if after]


def test_a_5000_node_tree_updates_without_long_tasks(chromium):
    """A run_batch's tree in the engine's RadixCache, growing from ~3,500 to ~5,000 nodes in 34 updates (the new
    nodes marked as the view marks them), drawn by the widget's own module: an overview that fits its box (the
    shared prefix and the fan-out under it, "+N" rows and folded subtrees saying how much they hold), and no
    main-thread task that takes over 100 ms of the main thread's own time while it updates. A task's time is read
    from chromium's trace (RunTask's thread time), not from the wall: on a 2-core machine with the suite's other
    worker busy, a ~30 ms update task was once stretched to 133 ms of wall by waiting for a core (the long-task
    API, which times the wall, is printed beside it). A 150 ms task made on purpose shows the trace sees tasks.
    A whitespace-only label shows its blanks."""
    import json

    from radix_workloads import FEWSHOT, ClassifyBatch

    from sgnb.widgets._esm import bundle

    batch = ClassifyBatch()
    batch.add(760)
    batch.nodes(mark_new=True)

    def message() -> str:
        rows, summary = build_rows(batch.nodes(mark_new=True), batch.label)
        return json.dumps({"nodes": rows, "summary": summary})

    with open_browser(chromium) as browser:
        page = browser.new_page(viewport={"width": 860, "height": 900})
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.add_init_script(f"window.ESM = {json.dumps(bundle('radix_tree.js'))};")
        page.route(ORIGIN + "**", lambda r: r.fulfill(status=200, content_type="text/html", body=WIDGET_PAGE % 800))
        try:
            page.goto(ORIGIN + "index.html")
            page.wait_for_function("window.READY === true", timeout=10_000)
            page.evaluate("(t) => window.deliver(t)", message())
            page.wait_for_function("document.querySelectorAll('.sgnb-rt-node').length > 20", timeout=10_000)
            page.wait_for_timeout(300)
            browser.start_tracing(page=page, categories=["devtools.timeline", "disabled-by-default-devtools.timeline"])
            page.evaluate("() => window.busy(150)")  # the instrument works: this one is seen
            page.wait_for_function("window.LONG.some(([, d]) => d >= 140)", timeout=5_000)
            page.evaluate("() => { window.LONG = []; console.timeStamp('updates'); }")

            sent = 0
            for _ in range(34):  # ~10 updates a second, each a message of its own
                batch.add(10)
                page.evaluate("(t) => window.deliver(t)", message())
                sent += 1
                page.wait_for_function(f"window.DELIVERED >= {sent + 1}", timeout=10_000)
                page.wait_for_timeout(100)
            page.wait_for_timeout(500)
            long_tasks = page.evaluate("window.LONG")
            before, updates = _main_thread_tasks(browser.stop_tracing(), "updates")
            assert any(w >= 140 and c > 0 for w, c in before), before  # the task made on purpose, with its thread time
            worst = sorted(updates, key=lambda t: -t[1])[:5]
            print(f"{sent} updates, {len(batch.nodes())} nodes; the longest main-thread tasks (wall ms, thread ms): "
                  f"{[(round(w), round(c)) for w, c in worst]}; long tasks by the wall: {long_tasks}")
            assert len(updates) > sent and all(c <= 100 for _, c in updates), worst

            rows = json.loads(message())["nodes"]
            page.evaluate("(t) => window.deliver(t)", json.dumps({"nodes": rows}))
            page.wait_for_function(f"window.DELIVERED >= {sent + 2}")
            page.wait_for_timeout(300)
            geo = page.evaluate("""() => {
              const scroll = document.querySelector('.sgnb-rt-scroll');
              return { drawn: document.querySelectorAll('.sgnb-rt-node').length, sum: document.querySelector('.sgnb-rt-sum').textContent,
                       scrollW: scroll.scrollWidth, clientW: scroll.clientWidth, layout: document.querySelector('.sgnb-rt').dataset.layout,
                       labels: [...document.querySelectorAll('.sgnb-rt-node text.main')].map(t => t.textContent),
                       subs: [...document.querySelectorAll('.sgnb-rt-node text.sub')].map(t => t.textContent) };
            }""")
            assert geo["drawn"] == len(rows) and geo["scrollW"] <= geo["clientW"], geo
            assert re.search(r"\d{4} nodes below the root", geo["sum"]) and "overview" in geo["sum"], geo["sum"]
            assert any(label.startswith("Classify the sentiment") for label in geo["labels"])
            assert any(re.search(r"\+\d+ below", sub) for sub in geo["subs"])  # folded subtrees count themselves
            assert any(label.startswith("+") for label in geo["labels"])  # and "+N" rows the rest
            ARTIFACTS.mkdir(exist_ok=True)
            page.locator(".sgnb-rt").screenshot(path=str(ARTIFACTS / "tree-5000-overview.png"))

            # a gen that wrote blanks only: its node's label shows them
            small = ClassifyBatch()
            small.insert_text(FEWSHOT + "Review: fine.\nSentiment: positive")
            small.insert_text(FEWSHOT + "Review: fine.\nSentiment: positive   ")
            small.insert_text(FEWSHOT + "Review: fine.\nSentiment: positive\n")
            r, s = build_rows(small.nodes(), small.label)
            page.evaluate("(t) => window.deliver(t)", json.dumps({"nodes": r, "summary": s}))
            page.wait_for_function("[...document.querySelectorAll('.sgnb-rt-node text.main')]"
                                   ".some(t => t.textContent === '␣␣␣')", timeout=5_000)
            assert not errors, errors
        finally:
            page.close()


def _deep_tree() -> tuple[list[Node], dict[int, str]]:
    """The lab panel's big tree (tests/labextension): "Topic a. Part b. Item c. Note d." for 3 x 4 x 4 x 4
    requests, 6 levels below the root; ids in insertion order, so the newest node is the last, deepest leaf."""
    nodes, texts, nid = [Node(0, None, 0, hits=12)], {}, 1
    for a in range(3):
        topic, nid = nid, nid + 1
        nodes.append(Node(topic, 0, 3, hits=47))
        texts[topic] = f"Topic {a}."
        for b in range(4):
            part, nid = nid, nid + 1
            nodes.append(Node(part, topic, 3, hits=15))
            texts[part] = f" Part {b}."
            for c in range(4):
                item, nid = nid, nid + 1
                nodes.append(Node(item, part, 3, hits=3))
                texts[item] = f" Item {c}."
                for d in range(4):
                    nodes.append(Node(nid, item, 4))
                    texts[nid] = f" Note {d}."
                    nid += 1
    return nodes, texts


# where the pinned root, the real root and the newest node are, against the scroll box's visible part
PINNED = """() => {
  const rt = document.querySelector('.sgnb-rt');
  const box = rt.querySelector('.sgnb-rt-scroll').getBoundingClientRect();
  const rect = (e) => { if (!e) return null; const r = e.getBoundingClientRect();
    return { top: r.top, bottom: r.bottom, left: r.left, right: r.right, width: r.width }; };
  const inside = (r) => !!r && r.width > 0 && r.top >= box.top - 1 && r.bottom <= box.bottom + 1
    && r.left >= box.left - 1 && r.left < box.right;
  const pin = rect(rt.querySelector('.sgnb-rt-pin')), root = rect(rt.querySelector('.sgnb-rt-node.root'));
  const newest = rect(rt.querySelector('.sgnb-rt-node.newest'));
  const overlap = (a, b) => !!a && !!b && a.width > 0 && b.width > 0 && a.left < b.right && b.left < a.right
    && a.top < b.bottom && b.top < a.bottom;
  return { pinned: rt.dataset.rootPinned, layout: rt.dataset.layout, newest: rt.dataset.newest,
           pinIn: inside(pin), pinText: rt.querySelector('.sgnb-rt-pin').innerText, rootIn: inside(root),
           newestIn: inside(newest), newestUnderPin: overlap(pin, newest) };
}"""


def test_following_the_newest_keeps_the_root_in_view(chromium):
    """"follow newest" down a tree taller and deeper than its box (the lab panel's 400 px): the newest node is
    in view and the root's row is pinned over the box's top-left corner, never over the newest; a click on the
    pin scrolls back to the root; a newer node is followed again; in columns too."""
    nodes, texts = _deep_tree()
    rows, summary = build_rows(nodes, lambda i, n: (texts.get(i, ""), []))
    assert len(rows) == len(nodes) == 256
    with open_browser(chromium) as browser:
        page = Page(browser, "light", 400)
        try:
            page.draw(rows, summary, fit=True, follow=True)
            at = page.page.evaluate(PINNED)
            assert at["layout"] == "outline" and at["newest"] == str(len(nodes) - 1), at
            assert at["newestIn"] and not at["rootIn"], at  # the newest is at the bottom, 250 rows down
            assert at["pinned"] == "1" and at["pinIn"] and at["pinText"].startswith("root"), at
            assert not at["newestUnderPin"], at
            ARTIFACTS.mkdir(exist_ok=True)
            page.page.locator(".sgnb-rt").screenshot(path=str(ARTIFACTS / "tree-follow-root-pinned.png"))

            page.page.locator(".sgnb-rt-pin").click()  # back to the root: the pin goes
            page.page.wait_for_function("document.querySelector('.sgnb-rt').dataset.rootPinned === '0'")
            assert page.page.evaluate(PINNED)["rootIn"]

            # a newer node, under the first topic: followed up the tree, the root pinned again
            nodes.append(Node(len(nodes), 4, 5, state="new"))
            texts[len(nodes) - 1] = " Item 9."
            rows, summary = build_rows(nodes, lambda i, n: (texts.get(i, ""), []))
            page.draw(rows, summary)
            at = page.page.evaluate(PINNED)
            assert at["newest"] == str(len(nodes) - 1) and at["newestIn"] and not at["newestUnderPin"], at

            # in columns (fit width off): 7 columns of 210 px in 400 px, followed sideways
            page.page.locator(".sgnb-rt-ctl input[name=fit]").uncheck()
            page.page.wait_for_selector(".sgnb-rt[data-layout='columns']")
            page.page.wait_for_timeout(100)
            at = page.page.evaluate(PINNED)
            assert at["newestIn"] and not at["newestUnderPin"], at
            assert not at["rootIn"] and at["pinned"] == "1" and at["pinIn"], at
            page.page.locator(".sgnb-rt").screenshot(path=str(ARTIFACTS / "tree-follow-root-pinned-columns.png"))
            assert not page.errors, page.errors
        finally:
            page.close()


@pytest.fixture(scope="module")
def small_engine():
    """The default model with a KV pool of 320 tokens: a few prompts fill it, and the tree evicts."""
    from sgnb.engine import Engine

    eng = Engine("smollm2", max_total_tokens=320)
    yield eng
    eng.shutdown()


def test_heat_after_a_run_and_evicted_nodes_stay_visible(small_engine, chromium):
    """Long prompts that do not fit the pool together (each evicts the one before), then a shared prompt hit
    again and again: after the run the evicted nodes are still drawn (red, dashed) in both views' rows, the
    idle tree's nodes are shaded by their hits (several heat levels, not uniform grey), and the summary
    counts the requests and evictions."""
    from sgnb.kernel_ext import panel
    from sgnb.widgets import RadixTreeView

    eng = small_engine
    eng.flush_cache()
    panel._Memory._per_engine.pop(eng, None)
    before = eng.get_stats()["requests_finished"]
    view = RadixTreeView(eng, live_seconds=0.5)
    params = {"max_new_tokens": 2, "temperature": 0}
    system = "You are a helpful assistant. Answer in one short sentence."
    for i in range(6):  # long prompts: the pool runs out and the least recently used leaves go
        eng.generate(f"Note {i}: " + " ".join(f"word{i}x{k}" for k in range(40)), params)
        panel.snapshot(eng)  # the panel saw this note: it draws it as evicted once it is gone
        time.sleep(0.1)  # the view's timer labels it too
    for q in ("Why is the sky blue?", "What is rain?", "Why is the sea salty?", "What is snow?"):
        for _ in range(2):
            eng.generate(eng.apply_chat_template([{"role": "system", "content": system},
                                                  {"role": "user", "content": q}]), params)
    time.sleep(0.6)  # idle for live_seconds
    view.flush()
    view.detach()
    rows, summary = view.nodes, view.summary
    assert summary["finished"] == before + 14 and summary["evicted_total"] > 0
    evicted = [r for r in rows if r["state"] == "evicted"]
    assert evicted and any("word" in r["text"] for r in evicted), ("evicted nodes are drawn, labelled", evicted)
    assert not [r for r in rows if r["state"] in ("new", "hit")]  # idle: no live colours
    levels = {r.get("heat", 0) for r in rows if r["state"] == ""}
    assert len(levels - {0}) >= 2, levels
    shown = panel.snapshot(eng)["tree"]
    assert [r for r in shown["nodes"] if r["state"] == "evicted"], "the panel shows them too"
    assert shown["summary"]["finished"] == before + 14

    with open_browser(chromium) as browser:
        page = Page(browser, "light", 1300)
        try:
            page.draw(rows, summary, fit=True)
            page.page.wait_for_timeout(500)
            drawn = page.page.evaluate(COLOURS)
            gone = [d for d in drawn if " evicted" in f" {d['cls']}"]
            assert len(gone) == len(evicted) and all(float(d["opacity"]) > 0.9 for d in gone), gone
            heats = {c for d in drawn for c in d["cls"].split() if c.startswith("heat-")}
            assert len(heats) >= 2, heats
            assert page.page.evaluate("document.querySelector('.sgnb-rt').dataset.live") == "0"
            sums = page.page.locator(".sgnb-rt-sum").inner_text()
            assert f"{before + 14} requests done" in sums and "evicted" in sums, sums
            assert page.page.locator(".sgnb-rt-legend").inner_text().count("hits") == 1
            ARTIFACTS.mkdir(exist_ok=True)
            page.page.locator(".sgnb-rt").screenshot(path=str(ARTIFACTS / "tree-heat-evicted.png"))
            assert not page.errors, page.errors
        finally:
            page.close()


def _every_kind_of_row() -> tuple[list[dict], dict]:
    nodes = [Node(0, None, 0), Node(1, 0, 20, hits=40, locked=True), Node(2, 1, 8, hits=12), Node(3, 1, 5, hits=3),
             Node(4, 1, 6, hits=1), Node(5, 2, 4, state="new"), Node(6, 2, 4, hits=2, state="hit"),
             Node(7, 3, 4, state="evicted"), Node(8, 3, 4)]
    nodes += [Node(100 + k, 4, 3) for k in range(30)]
    texts = {1: "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n",
             2: "Why is the sky blue?", 3: "What is rain?", 4: "List:", 5: " Because of scattering.",
             6: " Rayleigh", 7: " Water falling.", 8: "<|im_end|>\n<|im_start|>assistant\nDrops."}
    return build_rows(nodes, lambda i, n: (texts.get(i, f" item {i}"), []), max_nodes=300)


@pytest.mark.parametrize("theme", ["dark", "light"])
def test_every_kind_of_node_is_readable_in_the_theme(chromium, theme):
    """Heat levels, new, hit, evicted, locked, groups, the root and role chips under JupyterLab's own theme
    CSS: every label has at least 4.5:1 contrast against its box, and under the dark theme the boxes are dark
    (the drawing takes its colours from the theme's variables)."""
    rows, summary = _every_kind_of_row()
    with open_browser(chromium) as browser:
        page = Page(browser, theme, 900)
        try:
            page.draw(rows, summary, fit=False)
            nodes = _readability(page)
            kinds = {c for n in nodes for c in n["cls"].split()}
            assert {"new", "hit", "evicted", "locked", "group", "root"} <= kinds, kinds
            assert len([k for k in kinds if k.startswith("heat-")]) >= 3, kinds
            poor = [(n["label"], n["cls"], round(n["contrast"], 2)) for n in nodes if n["contrast"] < 4.5]
            assert not poor, poor
            if theme == "dark":
                bright = [(n["label"], n["cls"]) for n in nodes if n["luminance"] > 0.2]
                assert not bright, bright
                assert _luminance(_rgba(page.page.evaluate(BACKGROUND))) < 0.05
            ARTIFACTS.mkdir(exist_ok=True)
            page.page.locator(".sgnb-rt").screenshot(path=str(ARTIFACTS / f"tree-theme-{theme}.png"))
            assert not page.errors, page.errors
        finally:
            page.close()


# ---- 2. live in JupyterLab, dark theme -------------------------------------------------------------------
LIVE_CELLS = [
    """\
import time
from sgnb.engine import Engine
from sgnb.widgets import RadixTreeView
engine = Engine("smollm2", max_total_tokens=320)
for i in range(6):  # requests done before the view exists
    engine.generate(f"Warm-up {i}:", {"max_new_tokens": 1, "temperature": 0})""",
    """\
tree = RadixTreeView(engine, live_seconds=1.0)
display(tree)""",
    """\
params = {"max_new_tokens": 2, "temperature": 0}
system = "You are a helpful assistant. Answer in one short sentence."
for i in range(6):  # each evicts the one before
    engine.generate(f"Note {i}: " + " ".join(f"word{i}x{k}" for k in range(40)), params)
    time.sleep(0.2)
for q in ["Why is the sky blue?", "What is rain?", "Why is the sea salty?", "What is snow?"]:
    for _ in range(2):
        engine.generate(engine.apply_chat_template([{"role": "system", "content": system},
                                                    {"role": "user", "content": q}]), params)
time.sleep(1.5)
tree.flush()  # the view drains events on a CPU budget: on a loaded machine it can still be behind here
print("work done:", tree.summary["finished"], "requests,", tree.summary["evicted_total"], "evicted")""",
]


# every text the tree's summary line showed, in order
SUMMARIES = """() => {
  window.__sums = [];
  new MutationObserver(() => {
    const sum = document.querySelector('.sgnb-rt-sum');
    const last = window.__sums[window.__sums.length - 1];
    if (sum && sum.textContent && sum.textContent !== last) window.__sums.push(sum.textContent);
  }).observe(document.body, { subtree: true, childList: true, characterData: true });
}"""


@pytest.fixture
def dark_lab(tmp_path):
    """JupyterLab 4 with the dark theme over tmp_path/root (no token); yields the notebook's URL."""
    root = tmp_path / "root"
    root.mkdir()
    write_notebook(root / "tree.ipynb", LIVE_CELLS)
    with jupyter_server(tmp_path, root=root, settings={"themes": {"theme": "JupyterLab Dark"}},
                        kernels_for=["tree.ipynb"]) as url:
        yield url + "/lab/tree/tree.ipynb?reset"


def test_live_tree_in_jupyterlab_dark_theme(chromium, dark_lab):
    with open_browser(chromium) as browser:
        page = browser.new_page(viewport={"width": 1300, "height": 1000})
        page.goto(dark_lab)
        page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=90_000)
        assert page.evaluate("document.body.dataset.jpThemeLight") == "false"  # the dark theme is on
        page.evaluate(SUMMARIES)
        run_all_cells(page)
        page.wait_for_selector(".sgnb-rt-sum", timeout=180_000)  # (the kernel imports torch and loads the model)
        page.wait_for_selector(".jp-OutputArea-output:has-text('work done')", timeout=180_000)
        sums = page.evaluate("window.__sums")
        # the view came after six requests had finished: it counted them from its first picture on
        done = [int(m.group(1)) for t in sums for m in [re.search(r"(\d+) requests? done", t)] if m]
        assert done and done[0] >= 6 and done == sorted(done), sums
        page.wait_for_function("document.querySelector('.sgnb-rt').dataset.live === '0'", timeout=10_000)
        tree = page.locator(".sgnb-rt").first
        tree.scroll_into_view_if_needed()
        state = page.evaluate("""() => {
          const rt = document.querySelector('.sgnb-rt');
          const scroll = rt.querySelector('.sgnb-rt-scroll').getBoundingClientRect();
          const root = rt.querySelector('.sgnb-rt-node.root').getBoundingClientRect();
          return { fit: rt.querySelector('input[name=fit]').checked, layout: rt.dataset.layout,
                   rootIn: root.top >= scroll.top && root.left >= scroll.left && root.bottom <= scroll.bottom,
                   evicted: rt.querySelectorAll('.sgnb-rt-node.evicted').length,
                   heat: [...new Set([...rt.querySelectorAll('.sgnb-rt-node')].flatMap(g =>
                     [...g.classList].filter(c => c.startsWith('heat-'))))],
                   sum: rt.querySelector('.sgnb-rt-sum').textContent };
        }""")
        printed = page.locator(".jp-OutputArea-output:has-text('work done')").inner_text()
        ARTIFACTS.mkdir(exist_ok=True)
        tree.screenshot(path=str(ARTIFACTS / "tree-live-lab-dark.png"))
        assert state["fit"] and state["rootIn"], state
        assert state["evicted"] >= 1 and "evicted" in state["sum"], state
        assert len(state["heat"]) >= 2, state
        assert "20 requests done" in state["sum"] and "work done: 20 requests" in printed, (state, printed)
        bg = _rgba(page.evaluate("getComputedStyle(document.querySelector('.sgnb-rt-scroll')).backgroundColor"))
        assert _luminance(bg) < 0.05  # the theme's background, not a white box in a dark notebook
        colours = page.evaluate(COLOURS)
        poor = []
        for n in colours:
            box = _rgba(n["box"])
            fill = _over((*box[:3], box[3] * float(n["boxOpacity"])), bg)
            if _contrast(_over(_rgba(n["text"]), fill), fill) < 4.5 or _luminance(fill) > 0.2:
                poor.append((n["label"], n["cls"]))
        assert not poor, poor
