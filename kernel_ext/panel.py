"""The kernel half of the JupyterLab "LM engine" side panel: one call that returns what the panel draws.

The extension (labextension/) polls `snapshot_json()` 2-4 times a second while the panel is visible, through a
silent execute request's `user_expressions`; on a kernel with subshells (ipykernel 7) it asks on a subshell of
its own, so it gets answers while a cell is running. The call only reads: the radix tree under its lock and
the scheduler's counters; the engine does no work for it.

The tree comes as the rows that `widgets/radix_tree_draw.js` draws (its header documents them), so the panel
and the RadixTreeView widget draw with the same code; both label keys with `sgnb.widgets._media.key_label`, so
a node holding an image reads "[image]" in its text and carries the image's chip in "media". Node colours come
from the tree's own clocks: "new" = created, "hit" = matched again, within `HIGHLIGHT_S` of the tree's latest
activity (an idle tree keeps the colours of its last step); "evicted" = gone since an earlier call, for
`FADE_S` seconds.

Self-contained on purpose: it imports nothing of IPython and only `sgnb` itself (cheap, no torch), so a kernel
that never imported sgnb pays almost nothing to answer "no engine here".
"""

from __future__ import annotations

import heapq
import itertools
import json
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterable
from collections.abc import Set as AbstractSet
from typing import Any

from sgnb.widgets._media import key_label, key_media, key_text
from sgnb.widgets._series import stats_point

MAX_NODES = 300  # rows sent to the browser; a bigger tree is folded into "+N nodes" group rows
LABEL_TOKENS = 24  # tokens of each node's key decoded into its label
HIGHLIGHT_S = 1.0
FADE_S = 1.5
DETAIL_TOKENS = 4096


class JsonText(str):
    """A JSON document whose repr is itself, so a `user_expressions` reply (whose `text/plain` is the repr of
    the value) carries the document verbatim and the browser can `JSON.parse` it."""

    __slots__ = ()

    def __repr__(self) -> str:
        return str(self)


def current_engine() -> Any | None:
    """The in-process engine of the default backend (`sgnb.set_default_backend(sgnb.Runtime(...))`), or None
    when the default backend is unset or remote (RuntimeEndpoint, OpenAI, ...)."""
    import sgnb

    return getattr(sgnb.get_default_backend(), "engine", None)


def snapshot_json(max_nodes: int = MAX_NODES, collapsed: Iterable[int] = (), expanded: Iterable[int] = (),
                  selected: int | None = None) -> JsonText:
    """`snapshot()` of the current engine as a JSON string; {"engine": null, ...} when there is none. Its
    "seconds" is what the call took: the panel waits at least 49x that between calls, so that its share of
    the GIL (which the engine's scheduler thread needs too) stays under 2% even for a huge tree."""
    t0 = time.perf_counter()
    snap = snapshot(None, max_nodes, collapsed, expanded, selected)
    snap["seconds"] = round(time.perf_counter() - t0, 6)
    return JsonText(json.dumps(snap, default=str))


def snapshot(engine: Any | None = None, max_nodes: int = MAX_NODES, collapsed: Iterable[int] = (),
             expanded: Iterable[int] = (), selected: int | None = None) -> dict[str, Any]:
    """Without an in-process engine: {"engine": None, "backend": the default backend's class name or None}.
    Otherwise {"engine": {model, device, alive}, "stats": engine.get_stats(), "history": {series: points},
    "tree": {"nodes": rows, "summary": {...}, "details": {...}}}, in the formats that stats_draw.js and
    radix_tree_draw.js document: at most `max_nodes` rows (parents first; node ids are the tree's), with the
    subtrees of `collapsed` folded, the hidden children of `expanded` shown first, and `details` of the node
    `selected` (or {})."""
    if engine is None:
        import sgnb

        backend = sgnb.get_default_backend()
        engine = getattr(backend, "engine", None)
        if engine is None:
            return {"engine": None, "backend": type(backend).__name__ if backend is not None else None}
    tree = engine.tree
    # structure only: text is decoded for the rows that are sent, outside the tree's lock
    nodes = tree.snapshot(None, max_key=LABEL_TOKENS)
    memory = _Memory.of(engine)
    rows, summary = layout(nodes, max_nodes, set(collapsed), set(expanded), memory)
    for row in rows:
        key = row.pop("key", None)
        if "text" in row or row.get("group"):  # a group, or an evicted row that keeps its last label
            continue
        if row["parent"] is None:
            row["text"] = ""
            continue
        # the whole key (a dict read; a live key is replaced, never mutated): an image's pad ids count as one
        # token of the label, and an image anywhere in the key gets its chip
        live = tree.nodes.get(row["id"])
        row["text"], media = key_label(engine, live.key if live is not None else key, LABEL_TOKENS)
        if media:
            row["media"] = media
    stats = engine.get_stats()
    return {
        "engine": {"model": engine.model_name, "device": engine.runner.placement, "alive": engine.is_alive},
        "stats": stats,
        "history": memory.history(stats),
        "tree": {"nodes": rows, "summary": summary,
                 "details": details(engine, selected) if selected is not None else {}},
    }


def layout(nodes: list[dict], max_nodes: int, collapsed: AbstractSet[int] = frozenset(),
           expanded: AbstractSet[int] = frozenset(), memory: _Memory | None = None,
           ) -> tuple[list[dict], dict[str, Any]]:
    """Rows for a parent-first node list (`RadixCache.snapshot`): the root, then nodes best first (children of
    `expanded` nodes, then subtrees with fresh activity, then the biggest), each after its parent, while the
    rows (nodes plus one "+N nodes" group per node that has hidden children) fit in `max_nodes`. Node rows
    keep the engine node's `key` for the caller to decode; rows of evicted nodes come last."""
    assert max_nodes >= 2, "need room for the root and one group"
    by_id = {n["id"]: n for n in nodes}
    latest = max((n["last_access"] for n in nodes), default=0.0)
    horizon = latest - HIGHLIGHT_S
    children: dict[int, list[int]] = {n["id"]: [] for n in nodes}
    for n in nodes:
        if n["parent"] is not None:
            children[n["parent"]].append(n["id"])
    state: dict[int, str] = {}
    count: dict[int, int] = {}
    tokens: dict[int, int] = {}
    activity: dict[int, tuple[int, int]] = {}  # (new, hit) nodes in the subtree
    for n in reversed(nodes):  # children come after their parent: reversed order sees them first
        i = n["id"]
        s = state[i] = ("" if n["parent"] is None else "new" if n["created"] >= horizon
                        else "hit" if n["hit_count"] and n["last_access"] >= horizon else "")
        c, t, a_new, a_hit = 1, n["tokens"], int(s == "new"), int(s == "hit")
        for ch in children[i]:
            c, t = c + count[ch], t + tokens[ch]
            a_new, a_hit = a_new + activity[ch][0], a_hit + activity[ch][1]
        count[i], tokens[i], activity[i] = c, t, (a_new, a_hit)

    root = nodes[0]["id"] if nodes else None
    keep: set[int] = set()
    if root is not None:
        keep.add(root)
        hidden = {root: 0 if root in collapsed else len(children[root])}
        total = 1 + (1 if hidden[root] else 0)  # rows: kept nodes + one group per node with hidden children
        tie = itertools.count()

        def entry(c: int, parent: int) -> tuple:
            return (-(parent in expanded), -(sum(activity[c]) > 0), -count[c], next(tie), c)

        heap = [entry(c, root) for c in children[root]] if root not in collapsed else []
        heapq.heapify(heap)
        while heap:
            i = heap[0][-1]
            parent = by_id[i]["parent"]
            opens = 0 if i in collapsed else len(children[i])
            grows = 1 - (1 if hidden[parent] == 1 else 0) + (1 if opens else 0)
            if total + grows > max_nodes:
                break
            heapq.heappop(heap)
            keep.add(i)
            total += grows
            hidden[parent] -= 1
            hidden[i] = opens
            if opens:
                for c in children[i]:
                    heapq.heappush(heap, entry(c, i))

    rows: list[dict] = []
    groups = 0
    for n in nodes:
        i = n["id"]
        if i not in keep:
            continue
        kids = children[i]
        row = {"id": i, "parent": n["parent"], "key": n["key"], "tokens": n["tokens"], "hits": n["hit_count"],
               "locked": n["lock_ref"] > 0 and n["parent"] is not None, "state": state[i], "rids": 0,
               "kids": len(kids)}
        if i in collapsed and kids:
            row["collapsed"] = True
            row["hidden"] = count[i] - 1
        rows.append(row)
        lost = [c for c in kids if c not in keep]
        if lost and i not in collapsed:
            groups += 1
            new, hit = (sum(activity[c][k] for c in lost) for k in range(2))
            rows.append({"id": f"g{i}", "parent": i, "group": True, "children": len(lost),
                         "count": sum(count[c] for c in lost), "tokens": sum(tokens[c] for c in lost),
                         "new": new, "hit": hit, "evicted": 0,
                         "state": "new" if new else "hit" if hit else ""})
    shown = len(rows) - groups
    gone = memory.evicted(by_id, rows, root) if memory is not None else []
    rows += gone
    summary = {
        "nodes": len(nodes), "shown": shown, "groups": groups, "tokens": sum(n["tokens"] for n in nodes),
        "locked": sum(1 for n in nodes if n["lock_ref"] > 0 and n["parent"] is not None),
        "evicting": len(gone), "new": activity[root][0] if root is not None else 0,
        "hit": activity[root][1] if root is not None else 0, "max_nodes": max_nodes,
    }
    return rows, summary


def details(engine: Any, node_id: int) -> dict[str, Any]:
    """The selected node as radix_tree_draw.js shows it: its text, the text of the path above it, counts."""
    tree = engine.tree
    with tree.lock:
        node = tree.nodes.get(node_id)
        if node is None or node.parent is None:
            return {}
        own = list(node.key[:DETAIL_TOKENS])
        path, depth, p = [], len(node.key), node.parent
        while p is not None and p.parent is not None:
            path.append(p.key)
            depth += len(p.key)
            p = p.parent
        info = {"tokens": len(node.key), "hits": node.hit_count, "locked": node.lock_ref > 0}
        key = node.key  # replaced by a split, never mutated: safe to read after the lock
    media = key_media(engine, key, px=None)  # the engine's own thumbnails (one node's, not every row's)
    prefix_ids = [t for key in reversed(path) for t in key]
    prefix = key_text(engine, prefix_ids[-2000:])
    return {"id": node_id, "text": key_text(engine, own), "prefix": prefix,
            "prefix_truncated": len(prefix_ids) > 2000, "state": "", "rids": [], "n_rids": 0,
            "depth_tokens": depth, "media": media, **info}


# the stats charts, as stats_draw.js names them (the EngineStats widget samples the same series)
SERIES = ("hit_rate", "gen_tokens_per_s", "prefill_tokens_per_s", "kv_used_frac", "kv_cached_frac", "waiting",
          "running")
HISTORY_POINTS = 120


class _Memory:
    """What earlier calls saw of one engine: the nodes shown (to draw those gone since as fading "evicted"
    rows) and the stats (for the charts' series). Kept per engine, weakly, and shared by every panel polling
    it, which is fine: fading is on the clock and a series point is added only when the stats changed."""

    _per_engine: weakref.WeakKeyDictionary[Any, _Memory] = weakref.WeakKeyDictionary()
    _registry_lock = threading.Lock()

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seen: dict[int, dict] = {}  # id -> the row sent last time (nodes shown then)
        self.alive: set[int] = set()  # every node id of the tree last time
        self.gone: dict[int, tuple[float, dict]] = {}  # id -> (when it was noticed gone, its row)
        self.stats: dict[str, Any] | None = None
        self.series: dict[str, deque[float]] = {k: deque(maxlen=HISTORY_POINTS) for k in SERIES}

    @classmethod
    def of(cls, engine: Any) -> _Memory:
        with cls._registry_lock:
            mem = cls._per_engine.get(engine)
            if mem is None:
                mem = cls._per_engine[engine] = cls()
            return mem

    def evicted(self, by_id: dict[int, dict], rows: list[dict], root: int | None) -> list[dict]:
        """Rows for nodes shown before and gone now (for FADE_S seconds), hung under their parent row if it
        is still drawn, else under the root; records `rows` as what is shown now."""
        now = time.monotonic()
        with self.lock:
            for i in self.alive - by_id.keys():
                if i in self.seen and self.seen[i]["parent"] is not None:  # not an old root (flush_cache)
                    self.gone[i] = (now, {**self.seen[i], "state": "evicted", "locked": False})
            self.gone = {i: g for i, g in self.gone.items() if now - g[0] < FADE_S and i not in by_id}
            self.alive = set(by_id)
            self.seen = {r["id"]: r for r in rows if not r.get("group")}
            out = []
            placed = set(self.seen)
            for i, (_, row) in sorted(self.gone.items(), key=lambda g: (g[1][0], g[0])):
                parent = row["parent"] if row["parent"] in placed else root
                if parent is None:
                    continue
                out.append({**row, "parent": parent, "kids": 0})
                placed.add(i)
            return out

    def history(self, stats: dict[str, Any]) -> dict[str, list[float]]:
        """The series with a point for `stats` added if they changed since the last call. hit_rate is over
        the interval since then (cached / prompt tokens that arrived), the last point's when none arrived."""
        with self.lock:
            prev = self.stats
            if stats != prev:
                hits = self.series["hit_rate"]
                point = stats_point(prev, stats, hits[-1] if hits else 0.0)
                for k, v in point.items():
                    self.series[k].append(round(v, 4))
                self.stats = stats
            return {k: list(v) for k, v in self.series.items()}
