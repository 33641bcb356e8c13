"""The tree rows both radix-tree views draw (sgnb.widgets._tree_rows): one builder for the RadixTreeView widget and
the lab panel, the engine's view API they read through, and the events that name their requests."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sgnb.kernel_ext import panel
from sgnb.widgets import _radix_tree, _series, _tree_rows
from sgnb.widgets._tree_rows import (
    GLYPHS,
    MAX_LABEL_TOKENS,
    SIBLING_CAP,
    THINK_SCAN_TOKENS,
    Node,
    build_rows,
    display_label,
    heat_level,
)

PREFIX = "You are a helpful assistant. Answer briefly.\n"


def _labels(texts: dict[int, str]):
    return lambda i, n: (texts.get(i, f"node {i}"), [])


def _check_rows(rows: list[dict], nodes: list[Node], max_nodes: int) -> None:
    """Parents first, within the budget, every node drawn or counted in a group, every token counted."""
    seen = set()
    for r in rows:
        assert r["parent"] is None or r["parent"] in seen, r
        seen.add(r["id"])
    assert len(rows) <= max_nodes
    shown = [r for r in rows if not r.get("group")]
    below = sum(r.get("below", 0) for r in rows)  # the subtrees an overview folded into their tops
    assert len(shown) + sum(r["count"] for r in rows if r.get("group")) + below == len(nodes)
    assert sum(r["tokens"] + r.get("below_tokens", 0) for r in rows) == sum(n.tokens for n in nodes)


# ---- packaging ---------------------------------------------------------------------------------------------
def test_the_builder_and_the_panel_import_no_anywidget():
    code = ("import sys, sgnb.widgets._tree_rows, sgnb.kernel_ext.panel, sgnb.widgets\n"
            "heavy = {'anywidget', 'traitlets', 'torch', 'IPython', 'sgnb.engine.engine'} & set(sys.modules)\n"
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_one_builder_and_one_stats_history_for_both_views():
    assert panel.build_rows is _radix_tree.build_rows is _tree_rows.build_rows
    assert panel.StatsHistory is _series.StatsHistory
    assert not hasattr(panel, "SERIES")  # the series are defined in _series only


# ---- the budget and the overview ---------------------------------------------------------------------------
def test_rows_keep_the_budget_and_count_every_node():
    nodes = [Node(0, None, 0)]
    nid = 1
    for a in range(4):  # root -> 4 topics -> 5 parts -> 3 leaves: 1 + 4 + 20 + 60 nodes
        topic = nid
        nodes.append(Node(topic, 0, 3, hits=a))
        nid += 1
        for _ in range(5):
            part = nid
            nodes.append(Node(part, topic, 2))
            nid += 1
            for _ in range(3):
                nodes.append(Node(nid, part, 1))
                nid += 1
    for cap in (2, 5, 9, 16, 40, 300):
        rows, summary = build_rows(nodes, _labels({}), max_nodes=cap)
        _check_rows(rows, nodes, cap)
        assert summary["nodes"] == len(nodes) and summary["shown"] + summary["groups"] == len(rows)
    rows, _ = build_rows(nodes, _labels({}), max_nodes=300)
    assert len(rows) == len(nodes)  # it all fits: no groups
    # a folded node hides its subtree; an expanded one shows its children first, beyond the budget
    rows, _ = build_rows(nodes, _labels({}), max_nodes=300, collapsed={1})
    assert next(r for r in rows if r["id"] == 1)["hidden"] == 20 and not any(r["parent"] == 1 for r in rows)
    rows, _ = build_rows(nodes, _labels({}), max_nodes=6, expanded={0})
    assert {r["id"] for r in rows if r["parent"] == 0 and not r.get("group")} == {1, 22, 43, 64}


def test_siblings_of_one_shape_become_a_few_examples_and_a_count():
    nodes = [Node(0, None, 0), Node(1, 0, 10, hits=100)] + [Node(i, 1, 4) for i in range(2, 102)]
    nodes += [Node(200, 1, 3), Node(201, 200, 2), Node(202, 200, 2)]  # one branch of another shape
    rows, summary = build_rows(nodes, _labels({}), max_nodes=300)
    _check_rows(rows, nodes, 300)
    leaves = [r for r in rows if r["parent"] == 1 and not r.get("group") and r["kids"] == 0]
    assert len(leaves) == SIBLING_CAP and [r["id"] for r in leaves] == list(range(90, 102))  # the newest
    (group,) = [r for r in rows if r.get("group")]
    assert (group["children"], group["leaves"], group["shapes"], group["like_shown"]) == (88, 88, 1, True)
    assert {200, 201, 202} <= {r["id"] for r in rows}
    # a live change is never hidden among the examples' group
    nodes[10].state = "new"
    rows, _ = build_rows(nodes, _labels({}), max_nodes=300)
    assert 10 in {r["id"] for r in rows}
    rows, _ = build_rows(nodes, _labels({}), max_nodes=300, expanded={1})
    assert not [r for r in rows if r.get("group")]  # opened: every leaf


# ---- labels ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, shown", [
    ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
     "\ue000Be brief.\ue005\ue001Hi\ue005\ue002"),
    ("<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
     "\ue001Hi\ue005\ue002"),
    ("<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n", "\ue001Hi\ue005\ue002"),
    ("<s>[INST] Hi [/INST] Hello</s>", "\ue006\ue001 Hi \ue002 Hello\ue005"),
    ("<|user|>\nHi<|end|>\n<|assistant|>\n", "\ue001Hi\ue005\ue002"),
    ("<|im_start|>critic\nNo.", "\ue004No."),
    ("Plain text, a < b and [x].", "Plain text, a < b and [x]."),
    ("<|im_start|>assistant\n<think>\nplan\n</think>\n\nDone<|im_end|>", "\ue002\ue007plan\n\ue008Done\ue005"),
    ("[THINK]hm[/THINK]Yes", "\ue007hm\ue008Yes"),
    ("◁think▷hm◁/think▷Yes", "\ue007hm\ue008Yes"),  # Kimi's markers start with neither < nor [
    ("<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST]", "\ue006\ue001 \ue000Be brief.\n\ue005\nHi \ue002"),
])
def test_chat_template_markers_become_role_glyphs(text, shown):
    assert display_label(text) == shown
    assert set(shown) - set(text) <= set(GLYPHS.values())


def test_the_drawing_knows_every_glyph():
    """radix_tree_draw.js matches no markers itself: it draws the glyphs the rows carry, one entry of its GLYPHS
    table per glyph of _tree_rows, classed by the glyph's name."""
    js = Path(_tree_rows.__file__).with_name("radix_tree_draw.js").read_text()
    table = re.findall(r'^\s*"\\u([0-9a-f]{4})": \["(\w+)"', js, re.M)
    assert {chr(int(code, 16)): name for code, name in table} == {c: name for name, c in GLYPHS.items()}


def test_labels_say_where_siblings_part():
    # two siblings that read alike for longer than their labels: the builder reads them on to where they part
    shared = "The quick brown fox jumps over the lazy dog " * 3
    full = {2: shared + "and the cats sleep.", 3: shared + "and the dogs bark.", 4: "Something else."}
    asked: list[tuple[int, int]] = []

    def label(i: int, n: int) -> tuple[str, list]:
        asked.append((i, n))
        return (full.get(i, "") if n > 24 else full.get(i, "")[:40]), []

    nodes = [Node(0, None, 0), Node(1, 0, 3), Node(2, 1, 400), Node(3, 1, 60), Node(4, 1, 30)]
    rows, _ = build_rows(nodes, label, label_tokens=24)
    by_id = {r["id"]: r for r in rows}
    assert by_id[2]["text"] == full[2] and by_id[3]["text"] == full[3]
    assert by_id[2]["diff"] == by_id[3]["diff"] == len(shared) + len("and the ")
    assert "diff" not in by_id[4] and by_id[4]["text"] == full[4][:40]
    assert (2, MAX_LABEL_TOKENS) in asked and (3, 60) in asked and (4, 24) in asked
    assert asked.count((4, 30)) == 1  # once, for reasoning markers past its label: its label stays short
    # the label carries the glyphs, the text the tokens as decoded; a plain label is not sent twice
    rows, _ = build_rows([Node(0, None, 0), Node(1, 0, 5)], _labels({1: "<|im_start|>user\nHi"}))
    assert (rows[1]["text"], rows[1]["label"]) == ("<|im_start|>user\nHi", "\ue001Hi")
    rows, _ = build_rows([Node(0, None, 0), Node(1, 0, 5)], _labels({1: "Hi"}))
    assert "label" not in rows[1]


# ---- reasoning ---------------------------------------------------------------------------------------------
def test_rows_tell_reasoning_from_answer_through_the_path():
    """A block opened in one node and closed in a descendant: the nodes in between are all reasoning, the one
    that closes it part, the answer after it none; a node whose close lies past its label is read further."""
    texts = {1: "<|im_start|>assistant\n", 2: "<think>let me see", 3: " more thought", 4: " then</think>The answer",
             5: " and more after", 6: "No thinking here", 7: "<think>hm</think>Answer"}
    long_close = "x" * 100 + "</think>Done"  # closes past its first 24 "tokens"
    texts[8] = long_close
    asked: list[tuple[int, int]] = []

    def label(i: int, n: int) -> tuple[str, list]:
        asked.append((i, n))
        return texts[i][:n], []  # one character a token

    nodes = [Node(0, None, 0), Node(1, 0, 22), Node(2, 1, 17), Node(3, 2, 13), Node(4, 2, 23), Node(5, 4, 15),
             Node(6, 1, 16), Node(7, 1, 23), Node(8, 3, len(long_close)), Node(9, 8, 5)]
    texts[9] = " end."
    rows, _ = build_rows(nodes, label, label_tokens=24)
    by_id = {r["id"]: r for r in rows}
    assert by_id[2]["think"] == "part" and "think_inside" not in by_id[2]  # opens: "<think>" is a marker
    assert by_id[3]["think"] == "all" and by_id[3]["think_inside"]
    assert by_id[4]["think"] == "part" and by_id[4]["think_inside"]
    assert by_id[8]["think"] == "part" and (8, min(len(long_close), THINK_SCAN_TOKENS)) in asked
    for i in (1, 5, 6, 9):
        assert "think" not in by_id[i] and "think_inside" not in by_id[i], by_id[i]
    assert by_id[7]["think"] == "part" and by_id[7]["label"] == "\ue007hm\ue008Answer"
    assert (3, 13) not in asked and (6, 16) not in asked  # whole in their labels: not read again


def test_the_tree_view_marks_a_reasoning_models_reply(engine):
    """A real reply with a thinking block (forced by a regex on the default model) in the RadixTreeView. The
    engine caches the prompt with the grammar's forced "<think>" as one node (its marker lies past its label:
    read further) and the sampled rest as its child, which starts inside the block and closes it."""
    from sgnb.widgets import RadixTreeView

    engine.flush_cache()
    view = RadixTreeView(engine, live_seconds=0.0)
    prompt = engine.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True)
    out = engine.generate(prompt, {"max_new_tokens": 40, "temperature": 0,
                                   "regex": r"<think>[a-z ]{5,20}</think>The answer is [0-9]"})
    assert out["text"].startswith("<think>")
    view.flush()
    opened, closed = [r for r in view.nodes if r.get("think")]
    assert opened["think"] == "part" and "think_inside" not in opened and "<think>" not in opened["text"]
    assert closed["parent"] == opened["id"] and closed["think"] == "part" and closed["think_inside"]
    reasoning = out["text"][len("<think>"):out["text"].index("</think>")]
    assert reasoning.endswith(closed["text"].split("</think>")[0])  # the sampled rest of the reasoning
    assert GLYPHS["think_end"] in closed["label"] and closed["label"].endswith("The answer is ")
    view.detach()


# ---- heat --------------------------------------------------------------------------------------------------
def test_heat_grows_with_hits_on_a_log_scale():
    levels = [heat_level(h, 1000) for h in (0, 1, 3, 10, 30, 100, 1000)]
    assert levels[0] == 0 and levels == sorted(levels) and levels[-1] == _tree_rows.HEAT_LEVELS
    assert len(set(levels)) >= 5
    assert heat_level(1, 1) < _tree_rows.HEAT_LEVELS  # one hit in a young tree is not the hottest yet
    nodes = [Node(0, None, 0, hits=9), Node(1, 0, 5, hits=50), Node(2, 1, 5, hits=5), Node(3, 1, 5),
             Node(4, 1, 5, hits=50, state="evicted")]
    rows, summary = build_rows(nodes, _labels({}))
    heat = {r["id"]: r.get("heat", 0) for r in rows}
    assert heat == {0: 0, 1: 5, 2: heat_level(5, 50), 3: 0, 4: 0} and summary["max_hits"] == 50


# ---- the adapters' clocks ----------------------------------------------------------------------------------
def test_a_node_made_by_a_split_is_not_new():
    import numpy as np

    from sgnb.engine.radix_cache import RadixCache

    tree = RadixCache(lambda slots: None)
    tree.insert([1, 2, 3, 4], np.arange(4))
    (old,) = tree.root.children.values()
    old.created = old.last_access = time.monotonic() - 60  # cached a minute ago
    tree.insert([1, 2, 9], np.arange(3))  # splits it after [1, 2]
    upper = old.parent
    assert upper is not tree.root and upper.created == old.created
    states = {n.id: n.state for n in panel.nodes_of(tree.snapshot(None, max_key=0))}
    (leaf,) = [c for c in upper.children.values() if c is not old]
    assert (states[upper.id], states[old.id], states[leaf.id]) == ("", "", "new")


def test_a_view_keeps_evicted_nodes_with_their_labels_for_a_while(engine):
    from sgnb.widgets import RadixTreeView

    engine.flush_cache()
    view = RadixTreeView(engine, fade_seconds=0.5)
    engine.generate([PREFIX + "One?", PREFIX + "Two?"], {"max_new_tokens": 2, "temperature": 0})
    view.flush()
    before = {r["id"]: r["text"] for r in view.nodes if r["parent"] is not None}
    engine.flush_cache()  # evicts every node
    view.flush()
    gone = {r["id"]: r["text"] for r in view.nodes if r["state"] == "evicted"}
    assert gone == before and view.summary["evicted_total"] == len(before)
    assert view.summary["nodes"] == 1  # the new root alone is live
    time.sleep(0.6)
    view.flush()
    assert [r["parent"] for r in view.nodes] == [None] and view.summary["evicted_total"] == len(before)
    view.detach()


# ---- what the engine tells the views -----------------------------------------------------------------------
def test_insert_events_name_the_request_and_the_view_counts_requests_before_it(engine):
    from sgnb.widgets import RadixTreeView

    engine.flush_cache()
    seen: list[dict] = []
    unsubscribe = engine.subscribe(seen.append)
    engine.generate(PREFIX + "Who inserts this?", {"max_new_tokens": 2, "temperature": 0}, rid="rid-insert")
    unsubscribe()
    inserts = [e for e in seen if e["type"] == "insert"]
    assert inserts and {e["rid"] for e in inserts} == {"rid-insert"}

    view = RadixTreeView(engine)  # made after requests finished: it counts them
    assert view.summary["finished"] == engine.get_stats()["requests_finished"] > 0
    engine.generate(PREFIX + "And one more?", {"max_new_tokens": 2, "temperature": 0}, rid="rid-more")
    view.flush()
    assert view.summary["finished"] == engine.get_stats()["requests_finished"]
    leaf = max((r for r in view.nodes if not r.get("group")), key=lambda r: r["id"])
    view.selected = leaf["id"]
    assert view.details["rids"] == ["rid-more"]  # named by its insert event, not guessed
    view.detach()


def test_the_engine_view_api(engine):
    engine.flush_cache()
    engine.generate([PREFIX + "Alpha?", PREFIX + "Beta?"], {"max_new_tokens": 1, "temperature": 0})
    nodes = engine.tree_snapshot(max_key_tokens=10**6)["nodes"]
    by_id = {n["id"]: n for n in nodes}
    leaf = next(n for n in nodes if n["parent"] is not None and not any(m["parent"] == n["id"] for m in nodes))
    path = engine.node_path(leaf["id"])
    assert path[-1] == leaf["id"] and by_id[path[0]]["parent"] == nodes[0]["id"]
    assert all(by_id[b]["parent"] == a for a, b in zip(path, path[1:]))
    assert engine.node_key(leaf["id"]) == leaf["key"] and engine.key_text(engine.node_key(leaf["id"])) == leaf["text"]
    assert engine.node_path(nodes[0]["id"]) == []
    engine.flush_cache()
    assert engine.node_key(leaf["id"]) is engine.node_path(leaf["id"]) is None


def test_the_widget_and_the_panel_draw_the_same_rows(engine, monkeypatch):
    import sgnb
    from sgnb.widgets import RadixTreeView

    engine.flush_cache()
    before = sgnb.get_default_backend()
    sgnb.set_default_backend(sgnb.Runtime(engine=engine))
    panel._Memory._per_engine.pop(engine, None)
    try:
        view = RadixTreeView(engine, live_seconds=0.0)
        chat = [engine.apply_chat_template([{"role": "system", "content": "Be brief."},
                                            {"role": "user", "content": q}]) for q in ("Hi?", "Why?", "Who?")]
        engine.generate(chat, {"max_new_tokens": 2, "temperature": 0})
        engine.generate(chat[0], {"max_new_tokens": 2, "temperature": 0})
        view.flush()
        monkeypatch.setattr(panel, "LIVE_S", 0.0)  # both idle: no live colours, only heat
        snap = panel.snapshot()
        keys = ("id", "parent", "text", "label", "diff", "tokens", "hits", "heat", "locked", "state", "kids")
        mine = [{k: r.get(k) for k in keys} for r in view.nodes]
        theirs = [{k: r.get(k) for k in keys} for r in snap["tree"]["nodes"]]
        assert sorted(mine, key=lambda r: r["id"]) == sorted(theirs, key=lambda r: r["id"])
        assert any((r["label"] or "").startswith("\ue000Be brief.") for r in mine)
        assert any(r.get("heat") for r in mine)
        for k in ("nodes", "shown", "groups", "tokens", "max_hits", "finished"):
            assert view.summary[k] == snap["tree"]["summary"][k], k
        view.detach()
    finally:
        sgnb.set_default_backend(before)


def test_a_5000_node_tree_is_an_overview():
    """A run_batch of 1,100 classification programs in the engine's RadixCache (~5,000 nodes): an overview of at
    most OVERVIEW_ROWS rows and BREADTH children a node, every node drawn or counted (in a "+N" row or folded
    into its top), the branches right under the shared prefix all shown; opening a folded node shows its
    children on top of the overview."""
    from radix_workloads import ClassifyBatch

    from sgnb.widgets._tree_rows import BREADTH, OVERVIEW_ROWS

    batch = ClassifyBatch()
    batch.add(1100)
    nodes = batch.nodes()
    assert len(nodes) >= 4800
    rows, summary = build_rows(nodes, batch.label)
    _check_rows(rows, nodes, OVERVIEW_ROWS)
    assert summary["overview"] and summary["nodes"] == len(nodes) and summary["folded"] > 0
    kids: dict = {}
    for r in rows:
        if not r.get("group") and r["parent"] is not None:
            kids.setdefault(r["parent"], []).append(r["id"])
    assert max(len(k) for k in kids.values()) <= BREADTH
    (prefix,) = kids[0]
    assert next(r for r in rows if r["id"] == prefix)["text"].startswith("Classify the sentiment")
    under = batch.cache.nodes[prefix].children.values()
    assert sorted(kids[prefix]) == sorted(n.id for n in under)  # the first level of the fan-out, whole
    folded = next(r for r in rows if r.get("below"))
    opened, _ = build_rows(nodes, batch.label, expanded={folded["id"]})
    assert {n.id for n in batch.cache.nodes[folded["id"]].children.values()} <= {r["id"] for r in opened}
    # a tree within the budget is drawn whole, as before
    small = ClassifyBatch()
    small.add(40)
    rows, summary = build_rows(small.nodes(), small.label)
    assert not summary["overview"] and len(rows) == len(small.nodes()) and not summary["folded"]
