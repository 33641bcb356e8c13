"""The kernel half of the JupyterLab "LM engine" side panel: one call that returns what the panel draws.

The extension (labextension/) polls `snapshot_json()` 2-4 times a second while the panel is visible, through a
silent execute request's `user_expressions`; on a kernel with subshells (ipykernel 7) it asks on a subshell of
its own, so it gets answers while a cell is running. The call only reads: the tree's structure
(`Engine.tree_snapshot`), the text of the nodes it shows (`Engine.node_key`), the scheduler's counters; the
engine does no work for it.

The tree comes as the rows that `widgets/radix_tree_draw.js` draws, built by the same code as the
RadixTreeView widget's (`sgnb.widgets._tree_rows.build_rows`): the panel only adapts a snapshot into its nodes.
Node colours come from the tree's own clocks: "new" = created, "hit" = matched again, within `HIGHLIGHT_S` of
the tree's latest activity, until the tree has been idle for `LIVE_S`; "evicted" = shown by an earlier call
and gone since, for `EVICTED_S` seconds; any other node is shaded by its cumulative hits.

Self-contained on purpose: it imports nothing of IPython and, of sgnb, only `sgnb` itself and the widgets'
anywidget-free modules (cheap, no torch), so a kernel that never imported sgnb pays almost nothing to answer
"no engine here".
"""

from __future__ import annotations

import json
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from collections.abc import Set as AbstractSet
from typing import Any

from sgnb.widgets import _tree_rows
from sgnb.widgets._media import key_label
from sgnb.widgets._series import StatsHistory
from sgnb.widgets._tree_rows import Node, build_rows, node_details

MAX_NODES = 300  # rows sent to the browser; a bigger tree is folded into "+N nodes" group rows
LABEL_TOKENS = _tree_rows.LABEL_TOKENS
HIGHLIGHT_S = _tree_rows.HIGHLIGHT_S
LIVE_S = _tree_rows.LIVE_S
EVICTED_S = _tree_rows.EVICTED_S
HISTORY_POINTS = 120


class JsonText(str):
    """A JSON document whose repr is itself, so a `user_expressions` reply (whose `text/plain` is the repr of
    the value) carries the document verbatim and the browser can `JSON.parse` it."""

    __slots__ = ()

    def __repr__(self) -> str:
        return str(self)


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
    nodes = engine.tree_snapshot(max_key_tokens=0)["nodes"]  # structure only; labels for the rows shown
    stats = engine.get_stats()
    memory = _Memory.of(engine)
    rows, summary, info = memory.tree(engine, nodes, max_nodes, set(collapsed), set(expanded), selected)
    summary["finished"] = stats.get("requests_finished", 0)
    return {
        "engine": {"model": engine.model_name, "device": engine.runner.placement, "alive": engine.is_alive},
        "stats": stats,
        "history": memory.history(stats),
        "tree": {"nodes": rows, "summary": summary, "details": info},
    }


def nodes_of(snapshot_nodes: list[dict], now: float | None = None) -> list[Node]:
    """`Engine.tree_snapshot` nodes as the row builder's, their state read from the tree's own clocks (time
    .monotonic(); `now` for a test): new / hit within HIGHLIGHT_S of the latest activity, unless that was
    LIVE_S or more before `now`."""
    latest = max((max(n["created"], n["last_access"]) for n in snapshot_nodes), default=0.0)
    idle = (time.monotonic() if now is None else now) - latest >= LIVE_S
    horizon = latest - HIGHLIGHT_S
    out = []
    for n in snapshot_nodes:
        root = n["parent"] is None
        state = ("" if root or idle else "new" if n["created"] >= horizon
                 else "hit" if n.get("last_hit", 0.0) >= horizon and n["hit_count"] else "")
        out.append(Node(n["id"], n["parent"], n["tokens"], n["hit_count"], n["lock_ref"] > 0 and not root, state))
    return out


def layout(nodes: list[dict], max_nodes: int, collapsed: AbstractSet[int] = frozenset(),
           expanded: AbstractSet[int] = frozenset(),
           label: Callable[[int, int], tuple[str, list[dict]]] | None = None, gone: Iterable[Node] = (),
           now: float | None = None) -> tuple[list[dict], dict[str, Any]]:
    """Rows and summary (`build_rows`) for a snapshot's node list plus `gone` (evicted nodes still drawn);
    `label(id, tokens)` gives the text and media of the nodes shown (none: empty labels)."""
    return build_rows([*nodes_of(nodes, now), *gone], label or (lambda i, n: ("", [])), max_nodes=max_nodes,
                      collapsed=collapsed, expanded=expanded, label_tokens=LABEL_TOKENS)


class _Memory:
    """What earlier calls saw of one engine: the tree's nodes and the labels shown (to draw nodes gone since as
    "evicted" rows), and the stats (for the charts' series). Kept per engine, weakly, and shared by every panel
    polling it, which is fine: evicted rows are on the clock and a series point is added only when the stats
    changed."""

    _per_engine: weakref.WeakKeyDictionary[Any, _Memory] = weakref.WeakKeyDictionary()
    _registry_lock = threading.Lock()

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.alive: dict[int, dict] = {}  # the tree's nodes last time, by id
        self.labels: dict[int, tuple[str, list[dict]]] = {}  # the labels shown last time
        self.gone: dict[int, tuple[float, Node, tuple[str, list[dict]]]] = {}  # id -> (noticed, node, label)
        self.evicted_total = 0
        self.think: dict[Any, tuple[bool, bool, bool]] = {}  # build_rows' memo of the nodes' reasoning markers
        self.stats = StatsHistory(HISTORY_POINTS)

    @classmethod
    def of(cls, engine: Any) -> _Memory:
        with cls._registry_lock:
            mem = cls._per_engine.get(engine)
            if mem is None:
                mem = cls._per_engine[engine] = cls()
            return mem

    def tree(self, engine: Any, nodes: list[dict], max_nodes: int, collapsed: AbstractSet[int],
             expanded: AbstractSet[int], selected: int | None) -> tuple[list[dict], dict[str, Any], dict]:
        """Rows, summary and the details of `selected` for the tree `nodes`, with the nodes that vanished
        since the last call (and were shown then) drawn as evicted for EVICTED_S seconds."""
        now = time.monotonic()
        with self.lock:
            by_id = {n["id"]: n for n in nodes}
            root = nodes[0]["id"] if nodes else None
            for i in self.alive.keys() - by_id.keys():
                old = self.alive[i]
                if old["parent"] is None:
                    continue  # an old root (flush_cache)
                self.evicted_total += 1
                if i in self.labels:
                    node = Node(i, old["parent"], old["tokens"], old["hit_count"], False, "evicted")
                    self.gone[i] = (now, node, self.labels[i])
            fresh = sorted((g for i, g in self.gone.items() if now - g[0] < EVICTED_S and i not in by_id),
                           key=lambda g: g[0])[-_tree_rows.MAX_EVICTED:]
            self.gone = {g[1].id: g for g in fresh}
            for _, node, _ in fresh:  # hung under its parent while that is drawn, else under the root
                if node.parent not in by_id and node.parent not in self.gone:
                    node.parent = root

            def label(i: int, tokens: int) -> tuple[str, list[dict]]:
                if i in self.gone:
                    return self.gone[i][2]
                key = engine.node_key(i)
                return key_label(engine, key, tokens) if key is not None else ("", [])

            mine = sorted(nodes_of(nodes), key=lambda n: n.id)  # siblings in the order they were cached
            rows, summary = build_rows([*mine, *(g[1] for g in fresh)], label, max_nodes=max_nodes,
                                       collapsed=collapsed, expanded=expanded, label_tokens=LABEL_TOKENS,
                                       think_memo=self.think)
            summary["evicted_total"] = self.evicted_total
            self.alive = by_id
            self.labels = {r["id"]: (r["text"], r.get("media", [])) for r in rows
                           if not r.get("group") and r["state"] != "evicted"}
            info: dict[str, Any] = {}
            if selected is not None and selected != root:
                if selected in by_id:
                    info = node_details(engine, next(n for n in mine if n.id == selected))
                elif selected in self.gone:
                    info = node_details(engine, self.gone[selected][1], fallback_text=self.gone[selected][2][0])
            return rows, summary, info

    def history(self, stats: dict[str, Any]) -> dict[str, list[float]]:
        """The series with a point for `stats` added if they changed since the last call. hit_rate is over
        the interval since then (cached / prompt tokens that arrived), the last point's when none arrived."""
        with self.lock:
            self.stats.add(stats)
            return self.stats.lists()
