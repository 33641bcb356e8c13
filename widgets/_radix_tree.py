"""RadixTreeView: the engine's radix tree, live.

Cheap for the engine by construction: the callback the engine calls on its scheduler thread is a deque's own
`append` (a C call, no Python frame). A Ticker thread drains the deque at <= 20 Hz (less often when the tree
is so large that a tick is slow: the thread keeps under `Ticker.max_share`, 2%, of the CPU), keeps a mirror of
the tree from the events (insert/split/evict/lock/hit/reset/request), and syncs the rows that `_tree_rows`
builds from it (the lab panel builds its rows there too) in one `hold_sync` message. A full snapshot is read
only on attach and when the event stream has a gap; node text is read through the engine's view API
(`Engine.node_key`, `node_path`) for the nodes shown.

Colours: green = inserted, blue = hit, in the latest `highlight_seconds` of engine activity (measured on the
events' clock, so a quick step stays coloured), until the engine has been idle for `live_seconds`; red, dashed
= evicted, drawn for `fade_seconds` of wall time (20 s: long enough to be seen), then removed; any other node
is shaded by its cumulative hits (a heat scale), so an idle tree shows where the cache paid off. Every insert and hit event names its request, so a node knows the requests
that share it. The row format is documented at the top of `radix_tree_draw.js`.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import anywidget
import traitlets

from sgnb.engine.events import (
    Event,
    EvictEvent,
    HitEvent,
    InsertEvent,
    LockEvent,
    RequestEvent,
    ResetEvent,
    SplitEvent,
)
from sgnb.widgets._esm import bundle
from sgnb.widgets._media import CHIP_PX, key_label
from sgnb.widgets._ticker import Ticker
from sgnb.widgets._tree_rows import (
    EVICTED_S,
    HIGHLIGHT_S,
    LABEL_TOKENS,
    LIVE_S,
    MAX_EVICTED,
    Node,
    build_rows,
    node_details,
)

MAX_RIDS = 32  # request ids kept per node (the most recent)
EAGER_LABELS = 64  # nodes a flush labels as soon as they appear (an evicted node keeps its label)


class _Node(Node):
    """A node of the mirror: what the row builder reads (`Node`), plus the view's own bookkeeping."""

    __slots__ = ("children", "text", "text_tokens", "media", "ids", "born", "hit_t", "evicted_t", "recent_rids")

    def __init__(self, node_id: int, parent: int | None, tokens: int, born: float) -> None:
        super().__init__(node_id, parent, tokens)
        self.born = born
        self.children: list[int] = []
        self.text: str | None = None  # decoded label, None until needed (and again after a split)
        self.text_tokens = 0  # how many tokens `text` was decoded from
        self.media: list[dict[str, Any]] = []  # the images / videos in its key, found with the label
        self.ids: list[int] = []  # the start of its key, kept with the label: a label after a split or an eviction
        self.hit_t = 0.0
        self.evicted_t: float | None = None
        self.recent_rids: deque[str] = deque(maxlen=MAX_RIDS)

    def add_rid(self, rid: str) -> None:
        if rid not in self.recent_rids:
            self.recent_rids.append(rid)
            self.rids += 1


class RadixTreeView(anywidget.AnyWidget):
    """The engine's radix tree: nodes labelled with their text, token count, hit count and in-use lock.

    `RadixTreeView(engine)` attaches at once (a snapshot, then events); `.detach()` unsubscribes and stops the
    timer thread. Clicking a node in the frontend sets `selected`; the view answers with `details` (the node's
    full text and the requests that share it). `collapsed` / `expanded` (node ids) are set by the frontend to
    fold a subtree or open a "+N nodes" group. The drawing starts in "fit width".
    """

    _esm = bundle("radix_tree.js")

    nodes: traitlets.List[Any] = traitlets.List().tag(sync=True)  # rows as layout() builds them: validating each row is waste
    summary = traitlets.Dict().tag(sync=True)
    collapsed: traitlets.List[Any] = traitlets.List().tag(sync=True)
    expanded: traitlets.List[Any] = traitlets.List().tag(sync=True)
    selected = traitlets.Any(None, allow_none=True).tag(sync=True)
    details = traitlets.Dict().tag(sync=True)

    def __init__(self, engine: Any, *, max_nodes: int = 300, interval: float = 0.05,
                 highlight_seconds: float = HIGHLIGHT_S, live_seconds: float = LIVE_S,
                 fade_seconds: float = EVICTED_S, label_tokens: int = LABEL_TOKENS, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.engine = engine
        self.max_nodes = max(8, int(max_nodes))
        self.highlight_seconds = highlight_seconds
        self.live_seconds = live_seconds
        self.fade_seconds = fade_seconds
        self.label_tokens = label_tokens
        self.events_seen = 0
        self.flushes = 0
        self.snapshots = 0
        self._lock = threading.RLock()  # the mirror below: timer thread vs frontend messages (main thread)
        self._nodes: dict[int, _Node] = {}
        self._think_memo: dict[Any, tuple[bool, bool, bool]] = {}  # build_rows': the nodes' reasoning markers
        self._root: int | None = None
        self._requests: dict[str, str] = {}
        self._finished = 0  # requests the engine finished (not aborted): its count at attach, then events
        self._evicted = 0  # nodes evicted since attach
        self._last_seq: int | None = None
        self._clock = 0.0  # time of the latest event applied
        self._expiry: float | None = None  # when the next evicted node's time is up
        self._calm: float | None = None  # when the latest step's colours give way to the heat
        self._unlabelled: deque[int] = deque(maxlen=EAGER_LABELS)  # new nodes: labelled before they can go
        self._dirty = True
        # the engine calls this on its scheduler thread: a C-level append and nothing else
        self._events: deque[Event] = deque()
        self._callback: Callable[[Event], None] = self._events.append
        self._unsubscribe: Callable[[], None] | None = engine.subscribe(self._callback)
        self._resync()
        self.observe(self._on_frontend, names=["collapsed", "expanded"])
        self.observe(self._on_selected, names=["selected"])
        self._ticker = Ticker(self.flush, max(interval, 0.05), "sgnb-radix-tree-view")
        self.flush()
        self._ticker.start()

    # ---- lifecycle ---------------------------------------------------------------------------------------
    def detach(self) -> None:
        """Stop following the engine (unsubscribe, stop the timer thread); the last picture stays."""
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        self._ticker.stop()
        self.flush()

    @property
    def attached(self) -> bool:
        return self._unsubscribe is not None

    def close(self) -> None:
        self.detach()
        super().close()

    # ---- the mirror --------------------------------------------------------------------------------------
    def _resync(self) -> None:
        """Rebuild the mirror from a snapshot (on attach, and when events were missed)."""
        rows = self.engine.tree_snapshot(max_key_tokens=0)["nodes"]  # structure only, parents first
        stats = getattr(self.engine, "get_stats", None)
        self.snapshots += 1
        with self._lock:
            if stats is not None:  # the requests done before the view came (or while events were missed)
                self._finished = int(stats().get("requests_finished", self._finished))
            old = self._nodes
            self._nodes = {}
            for r in rows:
                n = _Node(r["id"], r["parent"], r["tokens"], 0.0)  # already cached: not "new"
                prev = old.get(n.id)
                if prev is not None:
                    n.text, n.text_tokens, n.media, n.born = prev.text, prev.text_tokens, prev.media, prev.born
                    n.ids = prev.ids
                    n.hit_t, n.recent_rids, n.rids = prev.hit_t, prev.recent_rids, prev.rids
                n.hits, n.locked = r["hit_count"], r["lock_ref"] > 0
                self._nodes[n.id] = n
                if n.parent is None:
                    self._root = n.id
                elif n.parent in self._nodes:
                    self._nodes[n.parent].children.append(n.id)
            for n in self._nodes.values():
                n.children.sort()  # siblings in the order they were cached, as the panel draws them
            self._clock = self._clock or time.time()
            self._dirty = True

    def flush(self) -> bool:
        """Apply the engine events received so far and sync the traits now. Returns False when nothing changed."""
        with self._lock:
            n = len(self._events)
            events = [self._events.popleft() for _ in range(n)]
            for e in events:
                seq = e.get("seq")
                if seq is not None and self._last_seq is not None and seq != self._last_seq + 1:
                    self._resync()  # a gap: the mirror may be wrong, start again from the tree itself
                if seq is not None:
                    self._last_seq = seq
                handler = _HANDLERS.get(e.get("type", ""))
                if handler is not None:
                    self._clock = max(self._clock, e.get("t") or time.time())
                    handler(self, e)
            self.events_seen += n
            while self._unlabelled:  # label new nodes now: once evicted, their text is gone from the engine
                i = self._unlabelled.pop()
                node = self._nodes.get(i)
                if node is not None and node.text is None and node.evicted_t is None:
                    self._label(i, self.label_tokens)
            now = time.time()
            if self._expiry is not None and now >= self._expiry:
                self._expire()
            if events:
                self._calm = self._clock + self.live_seconds
            elif self._calm is not None and now >= self._calm:
                self._calm = None  # idle: new / hit give way to the heat
                self._dirty = True
            if not (events or self._dirty):
                return False
            self._dirty = False
            self._sync()
            return True

    def _share(self, n: _Node | None, rid: str | None) -> None:
        """Record that request `rid` uses node `n` and the path above it."""
        if not rid:
            return
        while n is not None and n.parent is not None:
            n.add_rid(rid)
            n = self._nodes.get(n.parent)

    def _on_insert(self, e: InsertEvent) -> None:
        parent = self._nodes.get(e["parent"])
        if parent is None:
            self._resync()
            return
        if e["node"] in self._nodes:  # seen in the attach snapshot already
            return
        n = self._nodes[e["node"]] = _Node(e["node"], parent.id, e["tokens"], e.get("t", self._clock))
        parent.children.append(n.id)
        self._share(n, e.get("rid"))
        self._unlabelled.append(n.id)

    def _on_split(self, e: SplitEvent) -> None:
        child, parent = self._nodes.get(e["node"]), self._nodes.get(e["parent"])
        if child is None or parent is None or e["upper"] in self._nodes:
            if e["upper"] not in self._nodes:
                self._resync()
            return
        at = e["at"]
        upper = _Node(e["upper"], parent.id, at, child.born)  # the child's tokens, cut in two: not "new"
        upper.hits, upper.locked, upper.hit_t = child.hits, child.locked, child.hit_t
        upper.recent_rids, upper.rids = deque(child.recent_rids, maxlen=MAX_RIDS), child.rids
        upper.children = [child.id]
        parent.children[parent.children.index(child.id)] = upper.id
        child.parent, child.tokens, child.text = upper.id, max(child.tokens - at, 0), None
        upper.ids, child.ids = child.ids[:at], child.ids[at:]
        self._nodes[upper.id] = upper
        self._unlabelled.extend((upper.id, child.id))

    def _on_hit(self, e: HitEvent) -> None:
        rid, t = e.get("rid"), e.get("t", self._clock)
        for node_id in e.get("nodes", ()):
            n = self._nodes.get(node_id)
            if n is not None:
                n.hits += 1
                n.hit_t = t
                if rid:
                    n.add_rid(rid)

    def _on_evict(self, e: EvictEvent) -> None:
        t = time.time()
        for node_id in e.get("nodes", ()):
            n = self._nodes.get(node_id)
            if n is not None and n.evicted_t is None:
                n.evicted_t = t
                n.locked = False
                self._evicted += 1
        self._expiry = min(self._expiry or float("inf"), t + self.fade_seconds)
        if sum(1 for n in self._nodes.values() if n.evicted_t is not None) > MAX_EVICTED:
            self._expire(keep=MAX_EVICTED)

    def _on_lock(self, e: LockEvent) -> None:
        for node_id in e.get("nodes", ()):
            n = self._nodes.get(node_id)
            if n is not None:
                n.locked = e["type"] == "lock"

    def _on_reset(self, e: ResetEvent) -> None:
        """A new empty tree (flush_cache): nodes still drawn as evicted stay, hung under the new root."""
        root, old = e["root"], self._root
        new = _Node(root, None, 0, 0.0)
        keep = {i: n for i, n in self._nodes.items() if n.evicted_t is not None}
        for n in keep.values():
            if n.parent == old or n.parent not in keep:
                n.parent = root
                new.children.append(n.id)
        self._nodes = {root: new, **keep}
        self._root = root

    def _on_request(self, e: RequestEvent) -> None:
        rid, state = e.get("rid"), e.get("state")
        if rid is None:
            return
        if state == "finished":
            self._requests.pop(rid, None)
            if e.get("reason") != "abort":  # as the engine counts requests_finished
                self._finished += 1
        else:
            self._requests[rid] = state or "?"

    def _expire(self, keep: int | None = None) -> None:
        """Drop evicted nodes whose time is up (and the oldest beyond `keep` of them)."""
        now = time.time()
        evicted = sorted((n for n in self._nodes.values() if n.evicted_t is not None),
                         key=lambda n: n.evicted_t or 0.0)
        cut = len(evicted) - keep if keep is not None else 0
        gone = [n for k, n in enumerate(evicted) if k < cut or now >= (n.evicted_t or 0.0) + self.fade_seconds]
        for n in gone:
            del self._nodes[n.id]
            parent = self._nodes.get(n.parent) if n.parent is not None else None
            if parent is not None and n.id in parent.children:
                parent.children.remove(n.id)
        left = [n.evicted_t + self.fade_seconds for n in evicted if n.id in self._nodes and n.evicted_t]
        self._expiry = min(left) if left else None
        self._dirty = self._dirty or bool(gone)

    # ---- what the frontend gets ---------------------------------------------------------------------------
    def _state(self, n: _Node, idle: bool = False) -> str:
        if n.evicted_t is not None:
            return "evicted"
        if idle:
            return ""
        horizon = self._clock - self.highlight_seconds
        if n.born >= horizon and n.parent is not None:
            return "new"
        if n.hit_t >= horizon and n.hit_t > 0:
            return "hit"
        return ""

    def _label(self, node_id: int, tokens: int) -> tuple[str, list[dict[str, Any]]]:
        """The text of the node's first `tokens` tokens and its media (cached; an evicted node keeps its last)."""
        n = self._nodes[node_id]
        if n.text is not None and (n.text_tokens >= tokens or n.evicted_t is not None):
            return n.text, n.media
        key = self.engine.node_key(node_id) if n.evicted_t is None else None
        if key is None:  # gone from the engine: what the mirror kept of its key (split off a labelled node)
            if n.text is None and n.ids:
                n.text, n.media = self._decode(n.ids, tokens)
            return n.text or "", n.media
        n.ids = key[: 2 * self.label_tokens]
        n.text, n.media = self._decode(key, tokens)
        n.text_tokens = tokens
        return n.text, n.media

    def _read(self, node_id: int, tokens: int) -> str:
        """The text of a live node's first `tokens` tokens, not kept (build_rows reads it for reasoning markers)."""
        key = self.engine.node_key(node_id) if self._nodes[node_id].evicted_t is None else None
        return self._decode(key, tokens)[0] if key is not None else self._label(node_id, tokens)[0]

    def _decode(self, key: list[int], tokens: int) -> tuple[str, list[dict[str, Any]]]:
        try:
            return key_label(self.engine, key, tokens, CHIP_PX)
        except Exception:  # a view must not die of a key it cannot read
            return "", []

    def _sync(self) -> None:
        rows, summary = self.layout()
        with self.hold_sync():
            self.nodes = rows
            self.summary = summary
            if self.selected is not None:
                self.details = self._details(self.selected)
        self.flushes += 1

    def layout(self) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The rows to draw (parents first) and a summary (`_tree_rows.build_rows`)."""
        nodes, root = self._nodes, self._root
        if root is None or root not in nodes:
            return [], {"nodes": 0}
        idle = time.time() - self._clock >= self.live_seconds
        order, stack = [], [root]  # preorder: each node's children in the order the mirror keeps them
        while stack:
            n = nodes[stack.pop()]
            n.state = self._state(n, idle)
            order.append(n)
            stack.extend(c for c in reversed(n.children) if c in nodes)
        rows, summary = build_rows(order, self._label, max_nodes=self.max_nodes, collapsed=set(self.collapsed),
                                   expanded=set(self.expanded), label_tokens=self.label_tokens,
                                   think_memo=self._think_memo, read=self._read)
        summary.update(queued=sum(s == "queued" for s in self._requests.values()), finished=self._finished,
                       evicted_total=self._evicted, events=self.events_seen)
        return rows, summary

    def _details(self, node_id: Any) -> dict[str, Any]:
        n = self._nodes.get(node_id) if isinstance(node_id, int) else None
        if n is None or n.parent is None:
            return {}
        n.state = self._state(n, time.time() - self._clock >= self.live_seconds)
        out = node_details(self.engine, n, fallback_text=n.text or "")
        out["rids"] = list(n.recent_rids)[::-1]
        if not out["media"]:
            out["media"] = n.media
        return out

    def _on_frontend(self, change: dict[str, Any]) -> None:
        with self._lock:
            self._dirty = True
        self.flush()

    def _on_selected(self, change: dict[str, Any]) -> None:
        with self._lock:
            self.details = self._details(change["new"]) if change["new"] is not None else {}

    # ---- text forms --------------------------------------------------------------------------------------
    def __repr__(self) -> str:
        s = self.summary
        state = "attached" if self.attached else "detached"
        return (f"<RadixTreeView {max(s.get('nodes', 1) - 1, 0)} nodes below the root, {s.get('tokens', 0)} tokens "
                f"cached, {s.get('locked', 0)} in use, {s.get('finished', 0)} requests done, {state}>")

    def _repr_mimebundle_(self, **kwargs: Any) -> tuple[dict, dict] | None:
        """The widget view, a short text/plain and a static text/html snapshot of the tree as rows (what a
        renderer without the widget shows: GitHub, nbviewer, an exported page; see `_static.py`)."""
        from sgnb.widgets._static import with_snapshot

        return with_snapshot(self, super()._repr_mimebundle_(**kwargs))


# each kind's handler takes that kind's record (sgnb.engine.events)
_HANDLERS: dict[str, Callable[[RadixTreeView, Any], None]] = {
    "insert": RadixTreeView._on_insert,
    "split": RadixTreeView._on_split,
    "hit": RadixTreeView._on_hit,
    "evict": RadixTreeView._on_evict,
    "lock": RadixTreeView._on_lock,
    "unlock": RadixTreeView._on_lock,
    "reset": RadixTreeView._on_reset,
    "request": RadixTreeView._on_request,
}
