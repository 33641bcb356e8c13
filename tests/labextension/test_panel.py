"""The JupyterLab extension: the kernel half of the LM engine panel in-process, the same call through a real
kernel's subshell while a cell runs, and the built extension in JupyterLab in a real browser (Debian chromium,
driven by Playwright)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from browsers import ARTIFACTS, ROOT, jupyter_server, open_browser, run_all_cells, write_notebook

from sgnb.kernel_ext import panel


@pytest.fixture
def default_engine(engine):
    """The session engine as the default backend, with an empty tree; the previous default is put back."""
    import sgnb

    before = sgnb.get_default_backend()
    sgnb.set_default_backend(sgnb.Runtime(engine=engine))
    engine.flush_cache()
    panel._Memory._per_engine.pop(engine, None)  # no fading rows left from another test
    yield engine
    sgnb.set_default_backend(before)


def _params(n: int = 4) -> dict:
    return {"max_new_tokens": n, "temperature": 0}


# ---- the kernel half, in-process ---------------------------------------------------------------------------
def test_snapshot_without_an_in_process_engine():
    import sgnb

    before = sgnb.get_default_backend()
    try:
        sgnb.set_default_backend(None)
        snap = json.loads(panel.snapshot_json())
        assert snap.pop("seconds") >= 0 and snap == {"engine": None, "backend": None}

        class Remote:  # a backend that runs elsewhere has no .engine
            pass

        sgnb.set_default_backend(Remote())  # type: ignore[arg-type]
        assert json.loads(panel.snapshot_json())["backend"] == "Remote"
    finally:
        sgnb.set_default_backend(before)


def test_snapshot_json_follows_the_engine(default_engine, monkeypatch):
    monkeypatch.setattr(panel, "HIGHLIGHT_S", 60.0)  # "new" / "hit" however slow the machine is today
    eng = default_engine
    empty = json.loads(panel.snapshot_json())
    assert empty["engine"]["model"] == eng.model_name and empty["engine"]["alive"] is True
    assert [r["parent"] for r in empty["tree"]["nodes"]] == [None]  # the root alone

    eng.generate([f"The capital of {c} is" for c in ("France", "Italy", "Spain")], _params())
    text = panel.snapshot_json()
    assert isinstance(text, str) and repr(text) == text  # so a user_expressions reply carries it verbatim
    snap = json.loads(text)
    rows = snap["tree"]["nodes"]
    live = eng.tree_snapshot()["nodes"]
    assert {r["id"] for r in rows} == {n["id"] for n in live}  # small tree: every node, no groups
    assert snap["tree"]["summary"]["nodes"] == len(live)
    assert snap["tree"]["summary"]["tokens"] == eng.tree.total_size
    seen = set()
    for r in rows:  # parents first, in radix_tree_draw.js's row format
        assert r["parent"] is None or r["parent"] in seen
        seen.add(r["id"])
        assert {"id", "parent", "text", "tokens", "hits", "locked", "state", "kids"} <= r.keys()
    by_id = {r["id"]: r for r in rows}
    shared = [r for r in rows if r["parent"] is not None and r["kids"] == 3]
    assert len(shared) == 1 and shared[0]["text"].startswith("The capital of")
    assert all(by_id[r["id"]]["state"] == "new" for r in rows if r["parent"] is not None)  # just inserted
    eng.generate("The capital of France is", _params())
    again = {r["id"]: r for r in json.loads(panel.snapshot_json())["tree"]["nodes"]}
    assert again[shared[0]["id"]]["hits"] >= 1 and again[shared[0]["id"]]["state"] in ("hit", "new")
    assert snap["stats"]["requests_finished"] == eng.get_stats()["requests_finished"] - 1
    assert set(snap["history"]) >= {"hit_rate", "gen_tokens_per_s", "kv_used_frac", "waiting", "running"}

    selected = shared[0]["id"]
    details = json.loads(panel.snapshot_json(selected=selected))["tree"]["details"]
    assert details["id"] == selected and details["text"].startswith("The capital of")
    assert details["depth_tokens"] == details["tokens"]  # a child of the root


def test_flush_shows_the_gone_nodes_as_evicted_then_drops_them(default_engine, monkeypatch):
    eng = default_engine
    eng.generate(["Once upon a time", "Once upon a hill"], _params(2))
    before = json.loads(panel.snapshot_json())["tree"]["nodes"]
    eng.flush_cache()
    after = json.loads(panel.snapshot_json())["tree"]
    evicted = [r for r in after["nodes"] if r["state"] == "evicted"]
    assert {r["id"] for r in evicted} == {r["id"] for r in before if r["parent"] is not None}
    assert after["summary"]["nodes"] == 1 and after["summary"]["evicting"] == len(evicted)
    monkeypatch.setattr(panel, "EVICTED_S", 0.0)
    assert [r["state"] for r in json.loads(panel.snapshot_json())["tree"]["nodes"]] == [""]


def test_a_big_tree_is_capped_with_groups_and_folds(default_engine):
    eng = default_engine
    eng.generate([f"Item {i}: the {w} is" for i in range(4) for w in ("cat", "dog", "sky", "sea", "sun")],
                 _params(2))
    full = json.loads(panel.snapshot_json())["tree"]
    n = full["summary"]["nodes"]
    assert n >= 20
    for cap in (2, 5, 9, 16):
        tree = json.loads(panel.snapshot_json(max_nodes=cap))["tree"]
        rows = tree["nodes"]
        assert len(rows) <= cap
        ids = set()
        for r in rows:
            assert r["parent"] is None or r["parent"] in ids
            ids.add(r["id"])
        shown = [r for r in rows if not r.get("group")]
        groups = [r for r in rows if r.get("group")]
        below = sum(r.get("below", 0) for r in shown)  # subtrees the overview folded into their tops
        assert len(shown) + sum(g["count"] for g in groups) + below == n  # every node drawn or counted
        assert sum(r["tokens"] + r.get("below_tokens", 0) for r in rows) == eng.tree.total_size
        assert tree["summary"]["groups"] == len(groups) and tree["summary"]["shown"] == len(shown)
    # folding a node hides its subtree; expanding a group shows its children first
    top = next(r for r in full["nodes"] if r["parent"] is not None and r["kids"])
    folded = json.loads(panel.snapshot_json(collapsed=[top["id"]]))["tree"]["nodes"]
    row = next(r for r in folded if r["id"] == top["id"])
    assert row["collapsed"] and row["hidden"] >= top["kids"]
    assert not any(r["parent"] == top["id"] for r in folded)


@pytest.fixture(scope="module")
def video_engine():
    """A LLaVA-NeXT-Video of random weights (the answers are noise, the tree is real), as the default backend."""
    import sgnb
    from sgnb.engine import Engine

    before = sgnb.get_default_backend()
    eng = Engine("dummy:tiny-llava-next-video")
    sgnb.set_default_backend(sgnb.Runtime(engine=eng))
    yield eng
    sgnb.set_default_backend(before)
    eng.shutdown()


def _write_video(path: Path) -> Path:
    """tests/llava_fixtures.py's write_video, imported by path (the suite runs with --import-mode=importlib)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("llava_fixtures", ROOT / "tests" / "llava_fixtures.py")
    assert spec is not None and spec.loader is not None
    module = sys.modules.get("llava_fixtures") or importlib.util.module_from_spec(spec)
    if "llava_fixtures" not in sys.modules:
        sys.modules["llava_fixtures"] = module
        spec.loader.exec_module(module)
    return module.write_video(path, frames=12)


def test_snapshot_shows_images_and_videos_as_chips(video_engine, tmp_path):
    """The panel's rows for a tree holding an image and a video: "[image]" / "[video]" once each in the text
    (the text around them kept), the snapshot's media as chips with small thumbnails, the engine's own
    thumbnail in the details; the same rows as the RadixTreeView widget's (one drawing code, one data)."""
    from PIL import Image

    from sgnb.widgets import RadixTreeView

    eng = video_engine
    eng.flush_cache()
    panel._Memory._per_engine.pop(eng, None)
    view = RadixTreeView(eng)
    img = Image.new("RGB", (64, 48), (220, 120, 30))
    clip = _write_video(tmp_path / "clip.mp4")
    for q in ("What is it?", "What colour is it?"):
        eng.generate(f"USER: <image>\n{q} ASSISTANT:", _params(2), image_data=img)
    eng.generate("USER: <video>\nWhat moves? ASSISTANT:", _params(2), video_data=(str(clip), 4))
    snap = json.loads(panel.snapshot_json())
    rows = {r["id"]: r for r in snap["tree"]["nodes"]}
    truth = {n["id"]: n for n in eng.tree_snapshot(max_key_tokens=10**6)["nodes"]}
    held = {i: r for i, r in rows.items() if r.get("media")}
    assert set(held) == {i for i, n in truth.items() if n.get("media")}
    kinds = sorted(m["kind"] for r in held.values() for m in r["media"])
    assert kinds == ["image", "video"]
    for i, r in held.items():
        assert [(m["kind"], m["hash"], m["tokens"]) for m in r["media"]] == \
            [(m["kind"], m["hash"], m["tokens"]) for m in truth[i]["media"]]
        for m in r["media"]:
            assert m["thumbnail"].startswith("data:image/jpeg;base64,") and len(m["thumbnail"]) < 4000
            assert r["text"].count(f"[{m['kind']}]") == 1
    (video,) = [r for r in held.values() if r["media"][0]["kind"] == "video"]
    assert "[video]\nWhat moves?" in video["text"]  # hundreds of pad ids count as one token of the label
    assert len(json.dumps(snap)) < 20_000

    view.flush()
    mine = {r["id"]: r for r in view.nodes}
    assert set(mine) == set(rows)
    for i, r in rows.items():  # the widget and the panel show the same text and chips
        assert (mine[i]["text"], mine[i].get("media")) == (r["text"], r.get("media")), i
    view.detach()

    picked = next(i for i, r in held.items() if r["media"][0]["kind"] == "image")
    details = json.loads(panel.snapshot_json(selected=picked))["tree"]["details"]
    assert details["text"] == truth[picked]["text"] and "[image]" in details["text"]
    assert details["media"][0]["thumbnail"] == truth[picked]["media"][0]["thumbnail"]  # the engine's own
    leaf = next(i for i, r in rows.items() if r["parent"] in held and not r.get("media"))
    assert "[" in json.loads(panel.snapshot_json(selected=leaf))["tree"]["details"]["prefix"]


def _node(i: int, parent: int | None, t: float = 0.0) -> dict:
    return {"id": i, "parent": parent, "tokens": 1, "lock_ref": 0, "hit_count": 0, "last_access": t,
            "created": t, "last_hit": 0.0, "key": [i]}


def test_layout_shows_the_children_of_an_expanded_group_first():
    # root 0 -> 1 -> (11 -> 111, 12 -> 121, 13 -> 131); root 0 -> 2, 3 (leaves): 1's children are bigger
    nodes = [_node(0, None), _node(1, 0), _node(2, 0), _node(3, 0),
             *[n for c in (11, 12, 13) for n in (_node(c, 1), _node(c * 10 + 1, c))]]
    order = [0, 1, 11, 111, 12, 121, 13, 131, 2, 3]
    nodes.sort(key=lambda n: order.index(n["id"]))
    rows, _ = panel.layout(nodes, 6)
    assert [r["id"] for r in rows if not r.get("group")][:2] == [0, 1]  # the biggest subtree first
    assert {r["id"]: r["count"] for r in rows if r.get("group")}["g0"] == 2  # 2 and 3 folded into "+2 nodes"
    rows, _ = panel.layout(nodes, 6, expanded={0})
    shown = [r["id"] for r in rows if not r.get("group")]
    assert 2 in shown and 3 in shown and "g0" not in {r["id"] for r in rows}


def test_layout_colours_follow_the_trees_own_clock():
    # the latest activity is at t=100: within HIGHLIGHT_S of it, created = "new", matched again = "hit"
    # (unless the tree has been idle since for LIVE_S)
    nodes = [_node(0, None, 100.0), _node(1, 0, 50.0), _node(2, 1, 50.0), _node(3, 1, 99.5)]
    nodes[1]["last_access"] = nodes[1]["last_hit"] = 99.5  # an old node hit just now
    nodes[1]["hit_count"] = 2
    nodes[2]["hit_count"], nodes[2]["last_hit"] = 1, 50.0  # hit long ago
    rows, summary = panel.layout(nodes, 10, now=100.5)
    assert {r["id"]: r["state"] for r in rows} == {0: "", 1: "hit", 2: "", 3: "new"}
    assert (summary["new"], summary["hit"]) == (1, 1)
    # idle for LIVE_S: the colours of the last step give way to the heat of cumulative hits
    rows, summary = panel.layout(nodes, 10, now=100.0 + panel.LIVE_S)
    assert {r["id"]: (r["state"], r.get("heat", 0)) for r in rows} == {0: ("", 0), 1: ("", 3), 2: ("", 2),
                                                                        3: ("", 0)}


# ---- the same call from the panel's side of a real kernel -------------------------------------------------
@pytest.mark.slow
def test_kernel_answers_on_a_subshell_while_a_cell_runs(tmp_path):
    """What the panel sends: a silent execute request with user_expressions, on a subshell of its own; it is
    answered while the main shell is still running a long cell."""
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3", cwd=str(tmp_path))
    try:
        info = kc.kernel_info(reply=True, timeout=60)["content"]
        if "kernel subshells" not in info.get("supported_features", []):
            pytest.skip(f"this ipykernel ({info.get('implementation_version')}) has no subshells")
        setup = kc.execute_interactive(
            "import sgnb\nsgnb.set_default_backend(sgnb.Runtime('smollm2'))", timeout=120)
        assert setup["content"]["status"] == "ok", setup["content"]

        control = kc.session.msg("create_subshell_request", {})
        kc.control_channel.send(control)
        reply = kc.get_control_msg(timeout=30)
        assert reply["parent_header"]["msg_id"] == control["header"]["msg_id"]
        subshell = reply["content"]["subshell_id"]

        long_cell = kc.execute("import time\nfor _ in range(8):\n"
                               "    sgnb.get_default_backend().engine.generate('Tell me a story', "
                               "{'max_new_tokens': 4, 'temperature': 0})\n    time.sleep(0.5)\n")
        time.sleep(1.0)  # the cell is running now
        probe = kc.session.msg("execute_request", {
            "code": "", "silent": True, "store_history": False, "allow_stdin": False, "stop_on_error": False,
            "user_expressions": {"sgnb": "__import__('sgnb.kernel_ext.panel', fromlist=['snapshot_json'])"
                                         ".snapshot_json()"}})
        probe["header"]["subshell_id"] = subshell
        kc.shell_channel.send(probe)
        order = []
        replies = {}
        deadline = time.time() + 120
        while len(order) < 2 and time.time() < deadline:
            msg = kc.get_shell_msg(timeout=60)
            parent = msg["parent_header"].get("msg_id")
            if parent in (long_cell, probe["header"]["msg_id"]):
                order.append(parent)
                replies[parent] = msg["content"]
        assert order == [probe["header"]["msg_id"], long_cell], "the probe waited for the running cell"
        result = replies[probe["header"]["msg_id"]]["user_expressions"]["sgnb"]
        assert result["status"] == "ok", result
        snap = json.loads(result["data"]["text/plain"])
        assert snap["engine"]["model"] and snap["tree"]["summary"]["nodes"] >= 2
        assert replies[long_cell]["status"] == "ok"
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


# ---- the built extension in JupyterLab, in a real browser --------------------------------------------------
GEN_CELLS = 5

NOTEBOOK_CELLS = [
    "import time\nimport sgnb as sgl\n\nsgl.set_default_backend(sgl.Runtime(\"smollm2\"))\n\n"
    "@sgl.function\ndef fact(s, topic):\n    s += sgl.user(f\"One short fact about {topic}.\")\n"
    "    s += sgl.assistant(sgl.gen(\"fact\", max_tokens=6, temperature=0))",
    *[f"state = fact.run(topic={topic!r})\ntime.sleep(1.2)  # time for the panel to show this step\n"
      f"print('gen cell {i} done:', state['fact'])"
      for i, topic in enumerate(["apples", "rivers", "the moon", "owls", "glass"][:GEN_CELLS])],
    "%load_ext sgnb",
    "%%sgl --temperature 0 --max-tokens 6 --no-widget\ns += user(\"Name a colour in one word.\")\n"
    "s += assistant(gen(\"colour\", stop=\"\\n\"))\nif \"colour\" in s:\n    print(\"sgl cell done\")",
    # a tree of a few hundred nodes, 6 levels deep (root, "Topic", a, b, c, d): columns would need ~1,300px
    "engine = sgl.get_default_backend().engine\n"
    "engine.generate([f'Topic {a}. Part {b}. Item {c}. Note {d}.' for a in range(3) for b in range(4)\n"
    "                 for c in range(4) for d in range(4)], {'max_new_tokens': 1, 'temperature': 0})\n"
    "print('big tree done:', len(engine.tree_snapshot(0)['nodes']), 'nodes')",
]


def _built_extension() -> Path:
    """labextension/build, rebuilt by the same setup.py step the wheel uses when a source is newer."""
    r = subprocess.run([sys.executable, "setup.py", "-q", "build_labextension"], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = ROOT / "labextension" / "build"
    assert (out / "package.json").exists()
    return out


@pytest.fixture
def jupyter_lab(tmp_path, chromium):
    """A JupyterLab server on a free port whose extension path puts this checkout's build first."""
    build = _built_extension()
    ext_dir = tmp_path / "labextensions"
    ext_dir.mkdir()
    (ext_dir / "sgnb").symlink_to(build, target_is_directory=True)
    root = tmp_path / "root"
    root.mkdir()
    write_notebook(root / "panel.ipynb", NOTEBOOK_CELLS)
    # the command palette in the left area: the modal one closes whenever something else takes the focus, as
    # the notebook does while its kernel starts
    with jupyter_server(tmp_path, root=root, settings={"palette": {"modal": False}},
                        args=[f"--LabApp.extra_labextensions_path={ext_dir}", "--LabApp.expose_app_in_browser=True"]
                        ) as url:
        with urllib.request.urlopen(f"{url}/lab/api/extensions", timeout=10) as r:
            names = {e["name"]: e for e in json.load(r)}
        assert "sgnb" in names, sorted(names)
        yield url, tmp_path


# records what the panel shows each time its DOM changes, with the notebook's progress at that moment
RECORDER = """
() => {
  window.__sgnbRecord = [];
  const sample = () => {
    const panel = document.querySelector('#sgnb-engine-panel');
    if (!panel) return;
    const drawn = panel.querySelectorAll('g.sgnb-rt-node:not(.root):not(.group)').length;
    const prompts = [...document.querySelectorAll('.jp-Notebook .jp-CodeCell .jp-InputPrompt')]
      .map(p => p.textContent.trim());
    const rec = window.__sgnbRecord;
    const last = rec[rec.length - 1];
    const entry = { t: performance.now(), nodes: Number(panel.dataset.nodes || 0), drawn,
                    status: panel.dataset.status || '', pending: prompts.filter(p => p.includes('*')).length,
                    done: prompts.filter(p => /\\[\\d+\\]/.test(p)).length };
    if (!last || last.nodes !== entry.nodes || last.drawn !== entry.drawn || last.status !== entry.status
        || last.pending !== entry.pending) rec.push(entry);
  };
  new MutationObserver(sample).observe(document.body, { subtree: true, childList: true, attributes: true,
                                                        characterData: true });
  sample();
}
"""


# the panel's tree: its layout, the widths of the panel and of the tree's scroll box, whether the newest node
# (outlined when "follow newest" is on) lies inside the scroll box's visible part, and the root: in view itself,
# or its row pinned over the box (radix_tree_draw.js) and not over the newest node
PANEL_GEOMETRY = """
() => {
  const panel = document.querySelector('#sgnb-engine-panel');
  const tree = panel.querySelector('.sgnb-rt');
  const scroll = panel.querySelector('.sgnb-rt-scroll');
  const newest = panel.querySelector('g.sgnb-rt-node.newest');
  const box = scroll.getBoundingClientRect();
  const n = newest ? newest.getBoundingClientRect() : null;
  const inView = (r) => !!r && r.width > 0 && r.top >= box.top - 1 && r.bottom <= box.bottom + 1
                        && r.left >= box.left - 1 && r.left < box.right;
  const root = panel.querySelector('g.sgnb-rt-node.root').getBoundingClientRect();
  const pin = panel.querySelector('.sgnb-rt-pin').getBoundingClientRect();
  return {
    layout: tree.dataset.layout, newest: tree.dataset.newest,
    drawn: panel.querySelectorAll('g.sgnb-rt-node:not(.root):not(.group)').length,
    panel_client_width: panel.clientWidth, panel_scroll_width: panel.scrollWidth,
    tree_client_width: scroll.clientWidth, tree_scroll_width: scroll.scrollWidth,
    newest_in_view: !!n && n.top >= box.top - 1 && n.bottom <= box.bottom + 1 && n.left >= box.left - 1
                    && n.left < box.right,
    root_in_view: inView(root), root_pinned: tree.dataset.rootPinned, pin_in_view: inView(pin),
    pin_text: panel.querySelector('.sgnb-rt-pin').innerText,
    newest_under_pin: !!n && pin.width > 0 && pin.left < n.right && n.left < pin.right && pin.top < n.bottom
                      && n.top < pin.bottom,
  };
}
"""


def _run_from_palette(page, label: str) -> None:
    """Run a command by its label from the command palette (in the left area: see `jupyter_lab`)."""
    page.evaluate("window.jupyterapp.commands.execute('apputils:activate-command-palette')")
    search = page.locator("#command-palette .lm-CommandPalette-input")
    search.fill(label)
    page.locator(f"#command-palette .lm-CommandPalette-item:has-text({label!r})").first.click()


@pytest.mark.slow
def test_panel_shows_the_tree_growing_while_cells_run(chromium, jupyter_lab):
    url, tmp_path = jupyter_lab
    ARTIFACTS.mkdir(exist_ok=True)
    with open_browser(chromium) as browser:
        page = browser.new_page(viewport={"width": 1600, "height": 1000})
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(f"{url}/lab/tree/panel.ipynb?reset")
        page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=60_000)

        page.wait_for_function("window.jupyterapp?.commands.hasCommand('sgnb:show-engine-panel')")
        page.evaluate("window.jupyterapp.restored")
        _run_from_palette(page, "sgnb: Show LM engine panel")
        panel = page.locator("#sgnb-engine-panel")
        panel.wait_for(state="visible", timeout=10_000)
        # the kernel answers before any engine exists: sgnb is importable there, no engine yet
        page.wait_for_selector("#sgnb-engine-panel[data-status='no-engine']", timeout=30_000)
        assert "%sgl model smollm2" in panel.inner_text()  # the empty state says what to type
        page.evaluate(RECORDER)

        page.locator(".jp-Notebook").first.click()
        run_all_cells(page)
        page.wait_for_selector("#sgnb-engine-panel[data-status='live']", timeout=90_000)
        page.wait_for_function("document.querySelector('#sgnb-engine-panel').dataset.nodes >= 2",
                               timeout=90_000)
        page.screenshot(path=str(ARTIFACTS / "labextension-panel-running.png"))
        page.wait_for_selector(f".jp-OutputArea-output:has-text('gen cell {GEN_CELLS - 1} done')",
                               timeout=120_000)
        page.wait_for_timeout(1500)  # the last poll after the last cell
        page.screenshot(path=str(ARTIFACTS / "labextension-panel-final.png"))
        record = page.evaluate("window.__sgnbRecord")

        # intermediate states: the drawn tree grew step by step while later cells were still queued
        running = [r for r in record if r["status"] == "live" and r["pending"] > 0]
        counts = sorted({r["drawn"] for r in running if r["drawn"] > 0})
        assert len(counts) >= 3, record
        grown = [r["drawn"] for r in record if r["status"] == "live"]
        assert grown == sorted(grown), "the tree shrank without evictions"
        final = record[-1]
        assert final["drawn"] >= GEN_CELLS and final["nodes"] >= final["drawn"], record
        assert panel.locator(".sgnb-st-tile").count() >= 3  # the stats drawing too

        # %%sgl: the magic line is one marked span, the body has Python token classes
        editor = page.locator(".cm-editor.sgnb-sgl-cell")
        editor.scroll_into_view_if_needed()
        assert editor.count() == 1
        assert editor.locator(".sgnb-cell-magic").first.inner_text().startswith("%%sgl --temperature 0")
        keywords = editor.locator(".tok-keyword").all_inner_texts()
        assert "if" in keywords and "in" in keywords, keywords
        assert editor.locator(".tok-string").count() >= 3
        assert editor.locator(".tok-variableName:has-text('assistant')").count() == 1
        # the plain Python cells get the same classes (the notebook's own language)
        assert page.locator(".cm-editor:not(.sgnb-sgl-cell) .tok-keyword:has-text('def')").count() >= 1
        page.screenshot(path=str(ARTIFACTS / "labextension-sgl-cell.png"))

        # a deep tree of a few hundred nodes fits the panel's default width (fit width, on by default),
        # and the newest node is in view (follow newest, on by default)
        page.wait_for_selector(".jp-OutputArea-output:has-text('big tree done')", timeout=180_000)
        page.wait_for_function("document.querySelector('#sgnb-engine-panel').dataset.nodes >= 250",
                               timeout=30_000)
        page.wait_for_timeout(1500)  # the last poll, drawn
        fit = page.evaluate(PANEL_GEOMETRY)
        assert fit["drawn"] >= 250 and fit["layout"] == "outline", fit
        assert fit["tree_scroll_width"] <= fit["tree_client_width"], f"the tree scrolls sideways: {fit}"
        assert fit["panel_scroll_width"] <= fit["panel_client_width"], f"the panel overflows: {fit}"
        assert fit["newest_in_view"], fit
        # following the newest, 250 rows down: the root's row is pinned in view (not over the newest), and
        # a click on it scrolls back to the root
        assert not fit["root_in_view"] and fit["root_pinned"] == "1" and fit["pin_in_view"], fit
        assert fit["pin_text"].startswith("root") and not fit["newest_under_pin"], fit
        page.screenshot(path=str(ARTIFACTS / "labextension-panel-big-tree.png"))
        panel.locator(".sgnb-rt-pin").click()
        page.wait_for_selector("#sgnb-engine-panel .sgnb-rt[data-root-pinned='0']", timeout=5_000)
        assert page.evaluate(PANEL_GEOMETRY)["root_in_view"]
        # without fit width the same tree is drawn in columns and scrolls sideways (the fallback)
        panel.locator(".sgnb-rt-ctl input[name=fit]").uncheck()
        page.wait_for_selector("#sgnb-engine-panel .sgnb-rt[data-layout='columns']", timeout=5_000)
        wide = page.evaluate(PANEL_GEOMETRY)
        assert wide["tree_scroll_width"] > wide["tree_client_width"] + 500, wide
        panel.locator(".sgnb-rt-ctl input[name=fit]").check()
        page.wait_for_selector("#sgnb-engine-panel .sgnb-rt[data-layout='outline']", timeout=5_000)
        assert not [e for e in errors if "sgnb" in e], errors
