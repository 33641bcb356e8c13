"""RadixTreeView: the engine's radix tree, live.

Cheap for the engine by construction: the callback the engine calls on its scheduler thread is a deque's own
`append` (a C call, no Python frame). A Ticker thread drains the deque at <= 20 Hz (less often when the tree
is so large that a tick is slow: the thread keeps under `Ticker.max_share`, 2%, of the CPU), keeps a mirror of
the tree from the events (insert/split/evict/lock/hit/reset), decodes the text of nodes it shows, aggregates
small subtrees into "+N nodes" groups so the frontend never gets more than about `max_nodes` rows, and syncs
them in one `hold_sync` message. A full snapshot is read only on attach and when the event stream has a gap.

Colours follow the SGLang paper's figure: green = inserted, blue = hit, in the latest `highlight_seconds` of
engine activity (measured on the events' clock, so an idle tree keeps the colours of its last step); red =
evicted, fading out over `fade_seconds` of wall time, then removed. The row format is documented at the top of
`radix_tree_draw.js`.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import anywidget
import traitlets

from sgnb.widgets._esm import bundle
from sgnb.widgets._media import CHIP_PX, key_label
from sgnb.widgets._ticker import Ticker

Event = dict[str, Any]
MAX_RIDS = 32  # request ids kept per node (the most recent)


class _Node:
    __slots__ = ("id", "parent", "children", "tokens", "hits", "locked", "text", "media", "born", "hit_t",
                 "evicted_t", "rids", "nrids")

    def __init__(self, node_id: int, parent: int | None, tokens: int, born: float) -> None:
        self.id, self.parent, self.tokens, self.born = node_id, parent, tokens, born
        self.children: list[int] = []
        self.hits = 0
        self.locked = False
        self.text: str | None = None  # decoded label, None until needed (and again after a split)
        self.media: list[dict[str, Any]] = []  # the images / videos in its key, found with the label
        self.hit_t = 0.0
        self.evicted_t: float | None = None
        self.rids: deque[str] = deque(maxlen=MAX_RIDS)
        self.nrids = 0

    def add_rid(self, rid: str) -> None:
        if rid not in self.rids:
            self.rids.append(rid)
            self.nrids += 1


class RadixTreeView(anywidget.AnyWidget):
    """The engine's radix tree: nodes labelled with their text, token count, hit count and in-use lock.

    `RadixTreeView(engine)` attaches at once (a snapshot, then events); `.detach()` unsubscribes and stops the
    timer thread. Clicking a node in the frontend sets `selected`; the view answers with `details` (the node's
    full text and the requests that share it). `collapsed` / `expanded` (node ids) are set by the frontend to
    fold a subtree or open a "+N nodes" group.
    """

    _esm = bundle("radix_tree.js")

    nodes = traitlets.List().tag(sync=True)  # rows as layout() builds them: validating each row is waste
    summary = traitlets.Dict().tag(sync=True)
    collapsed = traitlets.List().tag(sync=True)
    expanded = traitlets.List().tag(sync=True)
    selected = traitlets.Any(None, allow_none=True).tag(sync=True)
    details = traitlets.Dict().tag(sync=True)

    def __init__(self, engine: Any, *, max_nodes: int = 300, interval: float = 0.05,
                 highlight_seconds: float = 1.0, fade_seconds: float = 1.5, label_tokens: int = 32,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.engine = engine
        self.max_nodes = max(8, int(max_nodes))
        self.highlight_seconds = highlight_seconds
        self.fade_seconds = fade_seconds
        self.label_tokens = label_tokens
        self.events_seen = 0
        self.flushes = 0
        self.snapshots = 0
        self._lock = threading.RLock()  # the mirror below: timer thread vs frontend messages (main thread)
        self._nodes: dict[int, _Node] = {}
        self._root: int | None = None
        self._requests: dict[str, str] = {}
        self._finished = 0
        self._attributable: list[int] = []  # nodes inserted since the last lock/hit: owned by the next finisher
        self._last_seq: int | None = None
        self._clock = 0.0  # time of the latest event applied
        self._expiry: float | None = None  # when the next evicted node finishes fading
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
        tree = getattr(self.engine, "tree", None)
        if tree is not None:
            rows = tree.snapshot(None, max_key=0)  # structure only: no decoding under the tree's lock
        else:
            rows = self.engine.tree_snapshot(max_key_tokens=0)["nodes"]
        self.snapshots += 1
        with self._lock:
            old = self._nodes
            self._nodes = {}
            now = self._clock or time.time()
            for r in rows:  # parents come before children
                n = _Node(r["id"], r["parent"], r["tokens"], 0.0)  # already cached: not "new"
                prev = old.get(n.id)
                if prev is not None:
                    n.text, n.media, n.born = prev.text, prev.media, prev.born
                    n.hit_t, n.rids, n.nrids = prev.hit_t, prev.rids, prev.nrids
                n.hits, n.locked = r["hit_count"], r["lock_ref"] > 0
                self._nodes[n.id] = n
                if n.parent is None:
                    self._root = n.id
                elif n.parent in self._nodes:
                    self._nodes[n.parent].children.append(n.id)
            self._clock = now
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
            if self._expiry is not None and time.time() >= self._expiry:
                self._expire()
            if not (events or self._dirty):
                return False
            self._dirty = False
            self._sync()
            return True

    def _on_insert(self, e: Event) -> None:
        parent = self._nodes.get(e["parent"])
        if parent is None:
            self._resync()
            return
        if e["node"] in self._nodes:  # seen in the attach snapshot already
            return
        self._nodes[e["node"]] = _Node(e["node"], parent.id, e["tokens"], e.get("t", self._clock))
        parent.children.append(e["node"])
        self._attributable.append(e["node"])

    def _on_split(self, e: Event) -> None:
        child, parent = self._nodes.get(e["node"]), self._nodes.get(e["parent"])
        if child is None or parent is None or e["upper"] in self._nodes:
            if e["upper"] not in self._nodes:
                self._resync()
            return
        at = e["at"]
        upper = _Node(e["upper"], parent.id, at, child.born)
        upper.hits, upper.locked, upper.hit_t = child.hits, child.locked, child.hit_t
        upper.rids, upper.nrids = deque(child.rids, maxlen=MAX_RIDS), child.nrids
        upper.children = [child.id]
        parent.children[parent.children.index(child.id)] = upper.id
        child.parent, child.tokens, child.text = upper.id, max(child.tokens - at, 0), None
        self._nodes[upper.id] = upper
        self._attributable.append(upper.id)

    def _on_hit(self, e: Event) -> None:
        rid, t = e.get("rid"), e.get("t", self._clock)
        for node_id in e.get("nodes", ()):
            n = self._nodes.get(node_id)
            if n is not None:
                n.hits += 1
                n.hit_t = t
                if rid:
                    n.add_rid(rid)
        self._attributable.clear()

    def _on_evict(self, e: Event) -> None:
        t = time.time()
        for node_id in e.get("nodes", ()):
            n = self._nodes.get(node_id)
            if n is not None and n.evicted_t is None:
                n.evicted_t = t
                n.locked = False
        self._expiry = min(self._expiry or float("inf"), t + self.fade_seconds)
        self._attributable.clear()

    def _on_lock(self, e: Event) -> None:
        for node_id in e.get("nodes", ()):
            n = self._nodes.get(node_id)
            if n is not None:
                n.locked = e["type"] == "lock"
        if e["type"] == "lock":  # inserts followed by a lock were a running request's prefill: owner unknown
            self._attributable.clear()

    def _on_reset(self, e: Event) -> None:
        """A new empty tree (flush_cache): nodes still fading out stay, hung under the new root."""
        root, old = e["root"], self._root
        new = _Node(root, None, 0, 0.0)
        keep = {i: n for i, n in self._nodes.items() if n.evicted_t is not None}
        for n in keep.values():
            if n.parent == old or n.parent not in keep:
                n.parent = root
                new.children.append(n.id)
        self._nodes = {root: new, **keep}
        self._root = root
        self._attributable.clear()

    def _on_request(self, e: Event) -> None:
        rid, state = e.get("rid"), e.get("state")
        if rid is None:
            return
        if state == "finished":
            self._requests.pop(rid, None)
            self._finished += 1
            # a finishing request inserts its sequence, unlocks, then reports: those inserts are its own
            for node_id in self._attributable:
                n = self._nodes.get(node_id)
                while n is not None and n.parent is not None:
                    n.add_rid(rid)
                    n = self._nodes.get(n.parent)
        else:
            self._requests[rid] = state or "?"
        self._attributable.clear()

    def _expire(self) -> None:
        """Drop evicted nodes whose fade is over."""
        now, nxt = time.time(), None
        gone = []
        for n in self._nodes.values():
            if n.evicted_t is not None:
                if now >= n.evicted_t + self.fade_seconds:
                    gone.append(n)
                else:
                    nxt = min(nxt or float("inf"), n.evicted_t + self.fade_seconds)
        for n in gone:
            del self._nodes[n.id]
            parent = self._nodes.get(n.parent) if n.parent is not None else None
            if parent is not None and n.id in parent.children:
                parent.children.remove(n.id)
        self._expiry = nxt
        self._dirty = self._dirty or bool(gone)

    # ---- what the frontend gets ---------------------------------------------------------------------------
    def _state(self, n: _Node) -> str:
        if n.evicted_t is not None:
            return "evicted"
        horizon = self._clock - self.highlight_seconds
        if n.born >= horizon and n.parent is not None:
            return "new"
        if n.hit_t >= horizon and n.hit_t > 0:
            return "hit"
        return ""

    def _label(self, n: _Node) -> str:
        if n.text is None:
            n.text, n.media = self._decode(n.id, self.label_tokens) if n.parent is not None else ("", [])
        return n.text

    def _decode(self, node_id: int, limit: int, px: int | None = CHIP_PX) -> tuple[str, list[dict[str, Any]]]:
        """The node's label (`limit` tokens, an image counting as one) and its media (thumbnails `px`)."""
        tree = getattr(self.engine, "tree", None)
        live = tree.nodes.get(node_id) if tree is not None else None  # a dict read: no tree lock needed
        if live is None:
            return "", []
        try:
            return key_label(self.engine, live.key, limit, px)
        except Exception:
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
        """The rows to draw (parents first) and a summary. Above `max_nodes`, the largest / most active subtrees
        are shown and the rest of each node's children become one "+N nodes" group row."""
        nodes, root = self._nodes, self._root
        if root is None or root not in nodes:
            return [], {"nodes": 0}
        order, stack = [], [root]
        while stack:
            i = stack.pop()
            order.append(i)
            stack.extend(c for c in nodes[i].children if c in nodes)
        count: dict[int, int] = {}
        tokens: dict[int, int] = {}
        activity: dict[int, tuple[int, int, int]] = {}  # (new, hit, evicted) in the subtree
        states: dict[int, str] = {}
        for i in reversed(order):
            n = nodes[i]
            s = states[i] = self._state(n)
            c, t = 1, n.tokens
            a = [s == "new", s == "hit", s == "evicted"]
            for ch in n.children:
                if ch in count:
                    c, t = c + count[ch], t + tokens[ch]
                    ca = activity[ch]
                    a = [a[0] + ca[0], a[1] + ca[1], a[2] + ca[2]]
            count[i], tokens[i], activity[i] = c, t, (a[0], a[1], a[2])
        collapsed, expanded = set(self.collapsed), set(self.expanded)

        # choose nodes to show: parents before children, best subtrees first, within the budget; the children
        # of an expanded group come first and get a budget of their own (up to max_nodes more)
        shown: list[int] = []
        extra = 0
        tie = itertools.count()
        heap: list[tuple[int, int, int, int, int]] = [(0, 0, 0, next(tie), root)]
        while heap and len(shown) - extra < self.max_nodes:
            forced_entry, *_, i = heapq.heappop(heap)
            if forced_entry and extra < self.max_nodes:
                extra += 1
            shown.append(i)
            if i in collapsed:
                continue
            forced = i in expanded
            for ch in nodes[i].children:
                if ch in count:
                    a = activity[ch]
                    heapq.heappush(heap, (-int(forced), -int(a[0] + a[1] + a[2] > 0), -count[ch], next(tie), ch))
        shown_set = set(shown)
        rows = []
        groups = 0
        for i in order:  # preorder keeps parents first
            if i not in shown_set:
                continue
            n = nodes[i]
            kids = [c for c in n.children if c in count]
            row = {"id": i, "parent": n.parent, "text": self._label(n), "tokens": n.tokens, "hits": n.hits,
                   "locked": n.locked, "state": states[i], "rids": n.nrids, "kids": len(kids)}
            if n.media:
                row["media"] = n.media
            if i in collapsed:
                row["collapsed"] = True
                row["hidden"] = count[i] - 1
            rows.append(row)
            hidden = [c for c in kids if c not in shown_set]
            if hidden and i not in collapsed:
                groups += 1
                act = [sum(activity[c][k] for c in hidden) for k in range(3)]
                rows.append({"id": f"g{i}", "parent": i, "group": True, "children": len(hidden),
                             "count": sum(count[c] for c in hidden), "tokens": sum(tokens[c] for c in hidden),
                             "new": act[0], "hit": act[1], "evicted": act[2],
                             "state": "new" if act[0] else "hit" if act[1] else "evicted" if act[2] else ""})
        live = [n for n in nodes.values() if n.evicted_t is None]
        summary = {
            "nodes": len(live), "shown": len(shown), "groups": groups,
            "tokens": sum(n.tokens for n in live), "locked": sum(n.locked for n in live),
            "evicting": len(nodes) - len(live), "new": activity[root][0], "hit": activity[root][1],
            "queued": sum(s == "queued" for s in self._requests.values()), "finished": self._finished,
            "events": self.events_seen, "max_nodes": self.max_nodes,
        }
        return rows, summary

    def _details(self, node_id: Any) -> dict[str, Any]:
        n = self._nodes.get(node_id) if isinstance(node_id, int) else None
        if n is None:
            return {}
        text, media = self._decode(n.id, 4096, px=None)  # the engine's own thumbnails: only one node's
        text = text or self._label(n)
        path, p = [], self._nodes.get(n.parent) if n.parent is not None else None
        while p is not None and p.parent is not None:
            path.append(self._label(p))
            p = self._nodes.get(p.parent)
        prefix = "".join(reversed(path))
        return {"id": n.id, "text": text[:8000], "prefix": prefix[-2000:], "prefix_truncated": len(prefix) > 2000,
                "tokens": n.tokens, "hits": n.hits, "locked": n.locked, "state": self._state(n),
                "rids": list(n.rids)[::-1], "n_rids": n.nrids, "media": media or n.media,
                "depth_tokens": sum(self._nodes[q].tokens for q in self._ancestors(n.id))}

    def _ancestors(self, node_id: int) -> list[int]:
        out, n = [], self._nodes.get(node_id)
        while n is not None and n.parent is not None:
            out.append(n.id)
            n = self._nodes.get(n.parent)
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
        return (f"<RadixTreeView {max(s.get('nodes', 1) - 1, 0)} nodes below the root, {s.get('tokens', 0)} tokens cached, "
                f"{s.get('locked', 0)} in use, {state}>")


_HANDLERS: dict[str, Callable[[RadixTreeView, Event], None]] = {
    "insert": RadixTreeView._on_insert,
    "split": RadixTreeView._on_split,
    "hit": RadixTreeView._on_hit,
    "evict": RadixTreeView._on_evict,
    "lock": RadixTreeView._on_lock,
    "unlock": RadixTreeView._on_lock,
    "reset": RadixTreeView._on_reset,
    "request": RadixTreeView._on_request,
}
