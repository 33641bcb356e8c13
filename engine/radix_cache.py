"""RadixCache: an LRU radix tree over token ids whose nodes own KV slots (page size 1).

Contract:
- A node's `value` lists the KV slots of its `key` tokens (a host int64 numpy array: slot ids are host
  bookkeeping, engine/kv_pool.py); the tree owns those slots until it evicts them.
- `match_prefix` never frees anything; the indices it returns stay valid only while the returned node (or a
  descendant) is locked with `inc_lock_ref`, and they are read-only (a one-node match hands out the node's own
  slot array). It may split a node so that the match ends on a node boundary.
- `insert` adopts the slots of the part of `key` that was not in the tree and returns how many leading tokens
  were already there; the caller still owns (and must free) its slots for that already-present part, except
  for slots that are literally the tree's own (the prefix it matched before).
- `evict` frees least-recently-used unlocked leaves, cascading to parents that become unlocked leaves.
- Sizes: `evictable_size` counts tokens in unlocked nodes, `protected_size` tokens in locked ones.
- Events, through `emit(kind, data)` after each change (engine/events.py types each): reset {root}, insert {node, parent, tokens, rid (the
  request whose tokens they are, or None)}, split {node, upper (the new node above it), parent, at}, lock and
  unlock {nodes}, hit {nodes, tokens, rid}, evict {nodes, tokens}. Replaying them rebuilds the structure.
Only the scheduler thread mutates the tree; `snapshot` may be called from elsewhere while holding `lock`.
`host_seconds` sums the CPU time of the calling thread inside the operations the scheduler calls (match, insert,
locks, hits, evict): the cache's own host cost, which benchmarks set against a workload's wall time. Thread CPU
time, not wall time: with program threads beside the scheduler, wall time inside an operation also counts waits
for the GIL while other threads run.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import threading
import time
from collections.abc import Callable, Sequence
from time import thread_time  # the host-seconds clock (tests swap `time` for a fake monotonic one)
from typing import Any, NamedTuple

import numpy as np

from sgnb.engine.events import EventSink

_NO_SLOTS = np.empty(0, dtype=np.int64)
_NO_SLOTS.flags.writeable = False


def _timed(op: Callable) -> Callable:
    """Add the calling thread's CPU time during the call to the cache's `host_seconds`."""

    @functools.wraps(op)
    def run(self: RadixCache, *args: Any, **kwargs: Any) -> Any:
        t0 = thread_time()
        try:
            return op(self, *args, **kwargs)
        finally:
            self.host_seconds += thread_time() - t0

    return run


class TreeNode:
    __slots__ = ("id", "key", "value", "parent", "children", "lock_ref", "last_access", "hit_count", "created",
                 "last_hit")

    def __init__(self, node_id: int, key: list[int], value: np.ndarray, parent: TreeNode | None) -> None:
        self.id = node_id
        self.key = key
        self.value = value
        self.parent = parent
        self.children: dict[int, TreeNode] = {}
        self.lock_ref = 0
        self.last_access = time.monotonic()
        self.hit_count = 0
        self.created = self.last_access
        self.last_hit = 0.0  # when a request last matched it (record_hit); 0.0: never

    def __len__(self) -> int:
        return len(self.key)


class MatchResult(NamedTuple):
    indices: np.ndarray  # KV slots of the matched prefix, int64 (host)
    last_node: TreeNode  # deepest node of the match (the root when nothing matched)


def common_prefix_len(a: Sequence[int], b: Sequence[int], start: int = 0) -> int:
    """How many leading items of `a` equal those of `b[start:]` (without copying `b`'s tail: a 1k-token key
    is walked at every tree level and for every waiting request each round)."""
    n = min(len(a), len(b) - start)
    i = 0
    while i < n:  # 64 at a time by C-level slice comparison, then item by item inside the differing chunk
        j = min(i + 64, n)
        if a[i:j] != b[start + i: start + j]:
            break
        i = j
    while i < n and a[i] == b[start + i]:
        i += 1
    return i


class RadixCache:
    def __init__(self, free_slots: Callable[[np.ndarray], None], disable: bool = False,
                 emit: EventSink | None = None) -> None:
        self.free_slots = free_slots
        self.disable = disable
        self.emit: EventSink = emit or (lambda kind, data: None)
        self.lock = threading.RLock()  # guards structure against concurrent snapshot readers
        self._ids = itertools.count()
        self._empty = _NO_SLOTS
        self.host_seconds = 0.0  # CPU time inside the timed operations below
        self.reset()

    # ---- structure -------------------------------------------------------------------------------------
    def reset(self) -> None:
        with self.lock:
            self.root = TreeNode(next(self._ids), [], self._empty, None)
            self.root.lock_ref = 1  # the root is never evicted
            self.nodes: dict[int, TreeNode] = {self.root.id: self.root}
            self.evictable_size = 0
            self.protected_size = 0
        self.emit("reset", {"root": self.root.id})

    @property
    def total_size(self) -> int:
        return self.evictable_size + self.protected_size

    @_timed
    def match_prefix(self, key: list[int]) -> MatchResult:
        """Longest cached prefix of `key`. Splits a node when the match ends inside it. Frees nothing."""
        if self.disable or not key:
            return MatchResult(self._empty, self.root)
        with self.lock:
            node, i, parts = self.root, 0, []
            while i < len(key):
                child = node.children.get(key[i])
                if child is None:
                    break
                n = common_prefix_len(child.key, key, i)
                if n < len(child.key):
                    child = self._split(child, n)
                parts.append(child.value)
                node, i = child, i + n
            # one node: its own slots, no copy (callers only read)
            indices = parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else self._empty
            return MatchResult(indices, node)

    def prefix_len(self, key: list[int]) -> int:
        """Length of the cached prefix of `key`, with no side effect at all (for scheduling priorities)."""
        return self.prefix_walk(key)[0]

    @_timed
    def prefix_walk(self, key: list[int], hint: tuple[TreeNode, int] | None = None) -> tuple[int, tuple[TreeNode, int]]:
        """prefix_len(key), and a hint for the next call with the same key (or one that extends it): the
        deepest node whose whole path the key matched, and that path's length. With a hint whose node is still in
        the tree the walk starts there (a split leaves a node's path as it was; an evicted node is no longer in
        `nodes`): a waiting request's long prompt is compared once, not every round. No side effect."""
        if self.disable:
            return 0, (self.root, 0)
        with self.lock:
            node, i = self.root, 0
            if hint is not None and self.nodes.get(hint[0].id) is hint[0] and hint[1] <= len(key):
                node, i = hint
            at = (node, i)
            while i < len(key):
                child = node.children.get(key[i])
                if child is None:
                    break
                n = common_prefix_len(child.key, key, i)
                i += n
                if n < len(child.key):
                    break
                node = child
                at = (node, i)
            return i, at

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut `child` after n tokens; returns the new upper node, which keeps child's locks, stats and creation
        time (its tokens were cached when child's were: a split makes no new cache entry)."""
        parent = child.parent
        assert parent is not None and 0 < n < len(child.key)
        upper = TreeNode(next(self._ids), child.key[:n], child.value[:n], parent)
        upper.lock_ref, upper.last_access, upper.hit_count = child.lock_ref, child.last_access, child.hit_count
        upper.created, upper.last_hit = child.created, child.last_hit
        upper.children = {child.key[n]: child}
        parent.children[child.key[0]] = upper
        child.key, child.value, child.parent = child.key[n:], child.value[n:], upper
        self.nodes[upper.id] = upper
        self.emit("split", {"node": child.id, "upper": upper.id, "parent": parent.id, "at": n})
        return upper

    def insert(self, key: list[int], value: np.ndarray, rid: str | None = None) -> int:
        """Add `key` -> `value` slots. Returns how many leading tokens were already cached (see contract).
        `rid`, the request whose tokens these are, goes into the "insert" event (views show who shares a node)."""
        return self.insert_path(key, value, rid)[0]

    @_timed
    def insert_path(self, key: list[int], value: np.ndarray, rid: str | None = None) -> tuple[int, TreeNode]:
        """insert(), and the node where `key` ends (a node boundary: the walk splits where it must), which is
        match_prefix(key).last_node afterwards (the root when the cache is disabled)."""
        if self.disable:
            return 0, self.root
        assert len(key) == len(value), (len(key), len(value))
        with self.lock:
            node, i, now = self.root, 0, time.monotonic()
            while i < len(key):
                child = node.children.get(key[i])
                if child is None:
                    leaf = TreeNode(next(self._ids), list(key[i:]), value[i:].copy(), node)
                    node.children[key[i]] = leaf
                    self.nodes[leaf.id] = leaf
                    self.evictable_size += len(leaf)
                    self.emit("insert", {"node": leaf.id, "parent": node.id, "tokens": len(leaf), "rid": rid})
                    return i, leaf
                n = common_prefix_len(child.key, key, i)
                if n < len(child.key):
                    child = self._split(child, n)
                child.last_access = now
                node, i = child, i + n
            return i, node

    # ---- locks -----------------------------------------------------------------------------------------
    @_timed
    def inc_lock_ref(self, node: TreeNode) -> None:
        with self.lock:
            changed = []
            while node is not self.root:
                if node.lock_ref == 0:
                    self.evictable_size -= len(node)
                    self.protected_size += len(node)
                    changed.append(node.id)
                node.lock_ref += 1
                node = node.parent  # type: ignore[assignment]
        if changed:
            self.emit("lock", {"nodes": changed})

    @_timed
    def dec_lock_ref(self, node: TreeNode) -> None:
        with self.lock:
            changed = []
            while node is not self.root:
                assert node.lock_ref > 0, f"node {node.id} unlocked below zero"
                node.lock_ref -= 1
                if node.lock_ref == 0:
                    self.evictable_size += len(node)
                    self.protected_size -= len(node)
                    changed.append(node.id)
                node = node.parent  # type: ignore[assignment]
        if changed:
            self.emit("unlock", {"nodes": changed})

    @_timed
    def record_hit(self, node: TreeNode, request_id: str | None = None) -> None:
        """Count a request's use of the path root..node (LRU time and hit counts)."""
        now, ids, tokens = time.monotonic(), [], 0
        with self.lock:
            while node is not self.root:
                node.last_access = node.last_hit = now
                node.hit_count += 1
                ids.append(node.id)
                tokens += len(node)
                node = node.parent  # type: ignore[assignment]
        if ids:
            self.emit("hit", {"nodes": ids, "tokens": tokens, "rid": request_id})

    @_timed
    def common_prefix_depth(self, nodes: Sequence[TreeNode]) -> int:
        """Tokens on the path from the root to the deepest node that is an ancestor-or-self of every node
        in `nodes` (their shared cached prefix)."""
        with self.lock:
            path = []
            walk: TreeNode | None = nodes[0]
            while walk is not None:
                path.append(walk)
                walk = walk.parent
            path.reverse()  # root .. nodes[0]
            at = {id(n): i for i, n in enumerate(path)}
            deepest = len(path) - 1
            for node in nodes[1:]:
                up = node
                while id(up) not in at:
                    assert up.parent is not None  # the root is in `at`
                    up = up.parent
                deepest = min(deepest, at[id(up)])
                if deepest == 0:
                    return 0
            return sum(len(n) for n in path[1: deepest + 1])

    # ---- eviction --------------------------------------------------------------------------------------
    @_timed
    def evict(self, num_tokens: int) -> int:
        """Free at least num_tokens slots from unlocked LRU leaves if possible. Returns how many were freed."""
        if self.disable or num_tokens <= 0:
            return 0
        with self.lock:
            tie = itertools.count()
            heap = [(n.last_access, next(tie), n) for n in self.nodes.values()
                    if not n.children and n.lock_ref == 0 and n is not self.root]
            heapq.heapify(heap)
            freed, evicted = 0, []
            while freed < num_tokens and heap:
                _, _, node = heapq.heappop(heap)
                self.free_slots(node.value)
                freed += len(node)
                self.evictable_size -= len(node)
                parent = node.parent
                assert parent is not None
                del parent.children[node.key[0]]
                del self.nodes[node.id]
                evicted.append(node.id)
                if parent is not self.root and not parent.children and parent.lock_ref == 0:
                    heapq.heappush(heap, (parent.last_access, next(tie), parent))
        if evicted:
            self.emit("evict", {"nodes": evicted, "tokens": freed})
        return freed

    # ---- views -----------------------------------------------------------------------------------------
    def snapshot(self, token_text: Callable[[list[int]], str] | None = None, max_key: int = 64) -> list[dict]:
        """Every node as a dict (parent first). Reads the live tree under its lock."""
        out = []
        with self.lock:
            stack = [self.root]
            while stack:
                node = stack.pop()
                entry: dict[str, Any] = {
                    "id": node.id,
                    "parent": node.parent.id if node.parent is not None else None,
                    "tokens": len(node),
                    "lock_ref": node.lock_ref if node is not self.root else 0,
                    "hit_count": node.hit_count,
                    "last_access": node.last_access,
                    "created": node.created,
                    "last_hit": node.last_hit,
                    "key": node.key[:max_key],
                }
                if token_text is not None:
                    entry["text"] = token_text(node.key[:max_key])
                out.append(entry)
                stack.extend(node.children.values())
        return out
