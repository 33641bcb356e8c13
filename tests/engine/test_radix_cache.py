"""RadixCache over a real KVPool: deterministic contract tests, then a state machine that drives the cache
the way the scheduler does (match + lock + alloc, grow, cache-unfinished, finish/abort, evict, flush) and
checks it against a reference model: a prefix-closed map token-path -> KV slot of the path's last token."""

from __future__ import annotations

import types
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from engine_checks import tree_slots  # tests/engine_checks.py (tests/ is on sys.path: conftest)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from sgnb.engine import radix_cache
from sgnb.engine.kv_pool import KVPool
from sgnb.engine.radix_cache import RadixCache, TreeNode

Path = tuple[int, ...]
BIG = 1 << 30  # snapshot max_key: never truncate


def make_pool(num_slots: int) -> KVPool:
    return KVPool(num_slots)  # slot ids only: the tree never reads K/V


def slots(*xs: int) -> np.ndarray:
    return np.array(xs, dtype=np.int64)


def pool_free(pool: KVPool) -> list[int]:
    """Every slot the pool could hand out: its free list plus the lazily merged pending frees."""
    return pool._free.tolist() + [s for p in pool._pending for s in p.tolist()]


def node_path(node: TreeNode) -> Path:
    keys = []
    while node.parent is not None:
        keys.append(node.key)
        node = node.parent
    return tuple(t for key in reversed(keys) for t in key)


def tree_paths(cache: RadixCache) -> dict[Path, int]:
    """Every cached token path (all prefixes of root-to-leaf paths) -> the slot of its last token.

    Walks the live nodes and asserts the structural invariants on the way."""
    out: dict[Path, int] = {}
    seen = {cache.root.id}
    stack: list[tuple[TreeNode, Path]] = [(cache.root, ())]
    while stack:
        node, path = stack.pop()
        for first, child in node.children.items():
            assert child.key and child.key[0] == first, (child.id, child.key, first)
            assert child.parent is node
            assert len(child.value) == len(child.key) and child.value.dtype == np.int64
            assert cache.nodes.get(child.id) is child
            seen.add(child.id)
            p = path
            for tok, slot in zip(child.key, child.value.tolist()):
                p = (*p, tok)
                out[p] = slot
            stack.append((child, p))
    assert seen == set(cache.nodes), "nodes dict and reachable tree disagree"
    return out


def path_nodes(cache: RadixCache, key: list[int], n: int) -> list[TreeNode]:
    """The nodes covering key[:n], which must end on a node boundary, root excluded."""
    node, i, out = cache.root, 0, []
    while i < n:
        node = node.children[key[i]]
        assert node.key == key[i: i + len(node)], "path is not in the tree"
        out.append(node)
        i += len(node)
    assert i == n, "path does not end on a node boundary"
    return out


def latest(cache: RadixCache) -> float:
    return max(n.last_access for n in cache.nodes.values())


def longest(ref: dict[Path, int], key: list[int]) -> int:
    """Longest cached prefix of key under the (prefix-closed) reference."""
    n = 0
    while n < len(key) and tuple(key[: n + 1]) in ref:
        n += 1
    return n


def snapshot_leaf_paths(snap: list[dict]) -> set[Path]:
    by_id = {e["id"]: e for e in snap}
    parents = {e["parent"] for e in snap}
    out = set()
    for e in snap:
        if e["parent"] is None or e["id"] in parents:
            continue
        keys, cur = [], e
        while cur["parent"] is not None:
            keys.append(cur["key"])
            cur = by_id[cur["parent"]]
        out.add(tuple(t for key in reversed(keys) for t in key))
    return out


def maximal(ref: dict[Path, int]) -> set[Path]:
    """Paths of the reference that are not a proper prefix of another one: the root-to-leaf paths."""
    inner = {p[:-1] for p in ref}
    return {p for p in ref if p not in inner}


class Events:
    def __init__(self) -> None:
        self.log: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, kind: str, data: dict[str, Any]) -> None:
        self.log.append((kind, data))

    def take(self) -> list[tuple[str, dict[str, Any]]]:
        out, self.log = self.log, []
        return out


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """A strictly increasing fake clock for radix_cache only, so LRU order never depends on timer ties."""
    ticks = iter(range(1, 1 << 62))
    monkeypatch.setattr(radix_cache, "time", types.SimpleNamespace(monotonic=lambda: float(next(ticks))))


# ---- deterministic contract tests ------------------------------------------------------------------------

def test_insert_returns_already_present_length() -> None:
    cache = RadixCache(free_slots=lambda s: None)
    assert cache.insert([1, 2, 3, 4], slots(10, 11, 12, 13)) == 0
    assert cache.insert([1, 2, 5], slots(20, 21, 22)) == 2
    assert cache.insert([1, 2], slots(30, 31)) == 2
    assert cache.insert([1, 2, 3, 4], slots(40, 41, 42, 43)) == 4
    assert cache.insert([1, 2, 3, 4, 6], slots(50, 51, 52, 53, 54)) == 4
    assert cache.insert([], slots()) == 0
    assert cache.total_size == cache.evictable_size == 6  # 1 2 | 3 4 | 6 and 5
    assert sorted(tree_slots(cache).tolist()) == [10, 11, 12, 13, 22, 54]
    assert cache.match_prefix([1, 2, 3, 4, 6, 7]).indices.tolist() == [10, 11, 12, 13, 54]
    assert cache.match_prefix([1, 2, 5]).indices.tolist() == [10, 11, 22]


def test_match_splits_and_prefix_len_has_no_side_effect() -> None:
    ev = Events()
    cache = RadixCache(free_slots=lambda s: None, emit=ev)
    cache.insert([1, 2, 3, 4], slots(10, 11, 12, 13))
    before, n_nodes = cache.snapshot(), len(cache.nodes)
    ev.take()
    for key in ([1, 2, 9], [1, 2, 3, 4, 5], [1], [2], [], [1, 2, 3, 4]):
        assert cache.prefix_len(key) == longest({(1, 2, 3, 4)[:j]: 0 for j in range(1, 5)}, key)
    assert cache.snapshot() == before and len(cache.nodes) == n_nodes and ev.take() == []

    m = cache.match_prefix([1, 2, 9])
    assert m.indices.tolist() == [10, 11] and m.last_node.key == [1, 2]
    assert [c.key for c in m.last_node.children.values()] == [[3, 4]]
    assert m.last_node.parent is cache.root and len(cache.nodes) == 3
    assert cache.prefix_len([1, 2, 9]) == len(m.indices) == 2
    # a mismatch inside a node stops the walk even when one of its children starts with the mismatching token
    other = RadixCache(free_slots=lambda s: None)
    other.insert([1, 2, 3, 4], slots(10, 11, 12, 13))
    other.insert([1, 2, 3, 5], slots(20, 21, 22, 23))  # root -> [1 2 3] -> [4], [5]
    assert other.prefix_len([1, 4]) == other.prefix_len([1, 5, 5]) == 1
    assert other.prefix_len([1, 2, 5]) == 2 and other.prefix_len([1, 2, 3, 5, 1]) == 4
    assert len(other.match_prefix([1, 2, 5]).indices) == 2
    # a match ending on a boundary does not split again
    assert cache.match_prefix([1, 2]).last_node is m.last_node and len(cache.nodes) == 3
    assert cache.match_prefix([7]).last_node is cache.root
    assert cache.match_prefix([]).indices.size == 0
    assert cache.total_size == 4


def test_split_inside_locked_node_keeps_both_halves_locked() -> None:
    cache = RadixCache(free_slots=lambda s: None)
    cache.insert([1, 2, 3, 4], slots(10, 11, 12, 13))
    node = cache.match_prefix([1, 2, 3, 4]).last_node
    cache.inc_lock_ref(node)
    cache.inc_lock_ref(node)
    assert cache.protected_size == 4 and cache.evictable_size == 0
    upper = cache.match_prefix([1, 2]).last_node
    assert upper is not node and node.parent is upper and upper.key == [1, 2] and node.key == [3, 4]
    assert upper.lock_ref == node.lock_ref == 2
    assert cache.protected_size == 4 and cache.evictable_size == 0
    assert cache.evict(4) == 0
    cache.dec_lock_ref(node)
    cache.dec_lock_ref(node)
    assert upper.lock_ref == node.lock_ref == 0
    assert cache.protected_size == 0 and cache.evictable_size == 4
    # a lock taken on the upper half protects it while the lower half goes
    cache.inc_lock_ref(upper)
    assert cache.evict(1) == 2 and cache.total_size == cache.protected_size == 2


def test_lru_order(clock: None) -> None:
    freed: list[list[int]] = []
    cache = RadixCache(free_slots=lambda s: freed.append(s.tolist()))
    cache.insert([1, 1], slots(1, 2))  # A
    cache.insert([2, 2], slots(3, 4))  # B
    cache.insert([3, 3], slots(5, 6))  # C
    cache.record_hit(cache.match_prefix([1, 1]).last_node)
    assert cache.evict(1) == 2 and freed == [[3, 4]]  # B: least recently used
    assert cache.evict(1) == 2 and freed[-1] == [5, 6]  # then C
    assert cache.evict(1) == 2 and freed[-1] == [1, 2]
    assert cache.evict(1) == 0 and cache.total_size == 0


def test_insert_of_present_key_refreshes_lru(clock: None) -> None:
    freed: list[list[int]] = []
    cache = RadixCache(free_slots=lambda s: freed.append(s.tolist()))
    cache.insert([1, 1], slots(1, 2))
    cache.insert([2, 2], slots(3, 4))
    assert cache.insert([1, 1], slots(7, 8)) == 2
    assert cache.evict(1) == 2 and freed == [[3, 4]]


def test_evict_cascades_to_parent_and_skips_locked(clock: None) -> None:
    freed: list[int] = []
    cache = RadixCache(free_slots=lambda s: freed.extend(s.tolist()))
    cache.insert([1, 2, 3], slots(1, 2, 3))
    cache.insert([1, 2, 4], slots(9, 9, 4))  # splits [1 2 3] into [1 2] + [3], adds [4]
    cache.insert([5], slots(5))
    locked = cache.match_prefix([5]).last_node
    cache.inc_lock_ref(locked)
    assert cache.evict(0) == 0 and cache.evict(-3) == 0
    assert cache.evict(100) == 4 and sorted(freed) == [1, 2, 3, 4]
    assert cache.total_size == cache.protected_size == 1 and list(cache.nodes) == [cache.root.id, locked.id]


def test_disable_never_caches() -> None:
    freed: list[np.ndarray] = []
    cache = RadixCache(free_slots=freed.append, disable=True)
    assert cache.insert([1, 2, 3], slots(1, 2, 3)) == 0
    assert cache.insert([1, 2, 3], slots(1, 2, 3)) == 0
    m = cache.match_prefix([1, 2, 3])
    assert m.indices.size == 0 and m.last_node is cache.root
    assert cache.prefix_len([1, 2, 3]) == 0
    assert cache.evict(10) == 0 and freed == []
    assert cache.total_size == 0 and tree_slots(cache).numel() == 0 and list(cache.nodes) == [cache.root.id]


def test_reset_empties() -> None:
    cache = RadixCache(free_slots=lambda s: None)
    cache.insert([1, 2, 3], slots(1, 2, 3))
    cache.inc_lock_ref(cache.match_prefix([1, 2]).last_node)
    old_root = cache.root
    cache.reset()
    assert cache.root is not old_root and list(cache.nodes) == [cache.root.id]
    assert cache.total_size == cache.evictable_size == cache.protected_size == 0
    assert tree_slots(cache).numel() == 0 and cache.match_prefix([1, 2, 3]).indices.size == 0
    assert [e["id"] for e in cache.snapshot()] == [cache.root.id]


def test_events(clock: None) -> None:
    ev = Events()
    cache = RadixCache(free_slots=lambda s: None, emit=ev)
    root = cache.root.id
    assert ev.take() == [("reset", {"root": root})]

    cache.insert([1, 2, 3], slots(1, 2, 3), rid="r1")
    (a,) = cache.root.children.values()
    assert ev.take() == [("insert", {"node": a.id, "parent": root, "tokens": 3, "rid": "r1"})]
    assert cache.insert([1, 2, 3], slots(1, 2, 3)) == 3 and ev.take() == []  # nothing new: no event

    cache.insert([1, 2, 4], slots(7, 8, 4))
    upper = a.parent
    assert upper is not None and upper is not cache.root
    (b,) = [c for c in upper.children.values() if c is not a]
    assert ev.take() == [
        ("split", {"node": a.id, "upper": upper.id, "parent": root, "at": 2}),
        ("insert", {"node": b.id, "parent": upper.id, "tokens": 1, "rid": None}),
    ]

    cache.inc_lock_ref(a)
    assert ev.take() == [("lock", {"nodes": [a.id, upper.id]})]
    cache.inc_lock_ref(b)
    assert ev.take() == [("lock", {"nodes": [b.id]})]  # upper was already locked
    cache.inc_lock_ref(a)
    cache.dec_lock_ref(a)
    cache.dec_lock_ref(b)
    assert ev.take() == [("unlock", {"nodes": [b.id]})]
    cache.dec_lock_ref(a)
    assert ev.take() == [("unlock", {"nodes": [a.id, upper.id]})]
    cache.inc_lock_ref(cache.root)
    cache.dec_lock_ref(cache.root)
    assert ev.take() == []

    cache.record_hit(a, "r1")
    assert ev.take() == [("hit", {"nodes": [a.id, upper.id], "tokens": 3, "rid": "r1"})]
    assert a.hit_count == upper.hit_count == 1 and b.hit_count == 0
    cache.record_hit(cache.root)
    assert ev.take() == []

    assert cache.evict(10) == 4
    assert ev.take() == [("evict", {"nodes": [b.id, a.id, upper.id], "tokens": 4})]  # b is the LRU leaf
    assert cache.evict(10) == 0 and ev.take() == []
    cache.reset()
    assert ev.take() == [("reset", {"root": cache.root.id})] and cache.root.id != root


def test_snapshot_parent_links() -> None:
    cache = RadixCache(free_slots=lambda s: None)
    for key in ([1, 2, 3], [1, 2, 4], [1, 5], [2]):
        cache.insert(key, np.arange(1, len(key) + 1))
    snap = cache.snapshot(token_text=lambda toks: ",".join(map(str, toks)), max_key=1)
    seen: set[int] = set()
    for e in snap:
        assert e["parent"] is None or e["parent"] in seen
        seen.add(e["id"])
        assert len(e["key"]) <= 1 and e["text"] == ",".join(map(str, e["key"]))
    assert seen == set(cache.nodes)
    assert [e["id"] for e in snap if e["parent"] is None] == [cache.root.id], "one root, children name it"
    assert snapshot_leaf_paths(cache.snapshot(max_key=BIG)) == {(1, 2, 3), (1, 2, 4), (1, 5), (2,)}


# ---- the scheduler's use, against a reference model ------------------------------------------------------

keys = st.lists(st.integers(0, 3), min_size=1, max_size=20)


@dataclass(eq=False)  # identity: list.remove must not compare tensors
class Live:
    key: list[int]
    slots: np.ndarray  # its req_to_token row: KV slot of every token, [:cached_len] the tree's, the rest its own
    node: TreeNode  # the locked node; its path is key[:locked_len]
    locked_len: int
    cached_len: int  # <= locked_len (the scheduler recomputes at least the last token)


class RadixMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.live: list[Live] = []
        self.ref: dict[Path, int] = {}  # every cached path -> slot of its last token
        self.ev_parent: dict[int, int | None] = {}  # the tree as replayed from the events: node -> parent
        self.ev_locked: set[int] = set()
        self.hints: dict[tuple, tuple] = {}  # walk_on's hints, by key

    @initialize(size=st.sampled_from([24, 64, 128]))
    def setup(self, size: int) -> None:
        self.pool = make_pool(size)
        self.events = Events()
        self.cache = RadixCache(free_slots=self.pool.free, emit=self.events)

    # -- helpers --
    def _check_match(self, key: list[int]) -> radix_cache.MatchResult:
        n = longest(self.ref, key)
        assert self.cache.prefix_len(key) == n
        old = set(self.cache.nodes)
        m = self.cache.match_prefix(key)
        assert m.indices.tolist() == [self.ref[tuple(key[: j + 1])] for j in range(n)]
        for upper in (self.cache.nodes[i] for i in set(self.cache.nodes) - old):  # a split: upper keeps stats
            (lower,) = upper.children.values()
            assert lower.id in old and upper is m.last_node
            assert (upper.lock_ref, upper.hit_count, upper.last_access, upper.created, upper.last_hit) == (
                lower.lock_ref, lower.hit_count, lower.last_access, lower.created, lower.last_hit)
        assert node_path(m.last_node) == tuple(key[:n])
        return m

    def _evict(self, k: int) -> int:
        before = {e["id"]: e for e in self.cache.snapshot(max_key=BIG)}
        parents = {e["parent"] for e in before.values()}
        leaves = {i for i, e in before.items() if i != self.cache.root.id and i not in parents and e["lock_ref"] == 0}
        evictable, free_before = self.cache.evictable_size, set(pool_free(self.pool))
        live_slots = {s for r in self.live for s in r.slots.tolist()}

        freed = self.cache.evict(k)

        assert freed >= min(k, evictable) and freed <= (evictable if k > 0 else 0), (k, evictable, freed)
        assert self.cache.evictable_size == evictable - freed
        after = tree_paths(self.cache)
        assert all(p in self.ref and self.ref[p] == s for p, s in after.items()), "evict changed a kept slot"
        gone = {p: s for p, s in self.ref.items() if p not in after}
        newly_free = set(pool_free(self.pool)) - free_before
        assert len(gone) == freed and newly_free == set(gone.values())
        assert not newly_free & live_slots, "evict freed a slot a live request uses"
        for r in self.live:
            assert tuple(r.key[: r.locked_len]) in after or r.locked_len == 0, "evicted a locked path"
        evicted = set(before) - set(self.cache.nodes)
        kept_leaves = leaves - evicted
        if evicted and kept_leaves:  # everything popped from the heap was older than every leaf left in it
            assert max(before[i]["last_access"] for i in evicted) <= min(before[i]["last_access"] for i in kept_leaves)
        self.ref = after
        return freed

    def _alloc(self, n: int) -> np.ndarray | None:
        if n > self.pool.available:
            self._evict(n - self.pool.available)
        return self.pool.alloc(n)

    def _adopt(self, key: list[int], value: np.ndarray, present: int) -> None:
        for j in range(present, len(key)):
            self.ref[tuple(key[: j + 1])] = int(value[j])

    def _hit(self, key: list[int], n: int) -> None:
        """record_hit on the node ending key[:n]: its path becomes the most recently used and counts one hit."""
        path, before = path_nodes(self.cache, key, n), latest(self.cache)
        counts = [node.hit_count for node in path]
        self.cache.record_hit(path[-1] if path else self.cache.root, "rid")
        assert [node.hit_count for node in path] == [c + 1 for c in counts]
        assert all(node.last_access >= before for node in path)

    def _insert(self, r: Live) -> int:
        """insert as the scheduler does; the path that was already cached becomes the most recently used."""
        expect, before = longest(self.ref, r.key), latest(self.cache)
        present = self.cache.insert(r.key, r.slots)
        assert present == expect >= r.locked_len
        assert all(node.last_access >= before for node in path_nodes(self.cache, r.key, len(r.key)))
        self._adopt(r.key, r.slots, present)
        return present

    def _pick(self, i: int) -> Live:
        return self.live[i % len(self.live)]

    # -- rules --
    @rule(key=keys, drop=st.integers(0, 3))
    def request(self, key: list[int], drop: int) -> None:
        m = self._check_match(key)
        self.cache.inc_lock_ref(m.last_node)
        cached = max(len(m.indices) - drop, 0)
        new = self._alloc(len(key) - cached)
        if new is None:
            self.cache.dec_lock_ref(m.last_node)
            return
        if len(m.indices):
            self._hit(key, len(m.indices))
        self.live.append(Live(list(key), np.concatenate([m.indices[:cached], new]), m.last_node, len(m.indices), cached))

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 63), extra=st.lists(st.integers(0, 3), min_size=1, max_size=5))
    def grow(self, i: int, extra: list[int]) -> None:
        r = self._pick(i)
        new = self._alloc(len(extra))
        if new is not None:
            r.key += extra
            r.slots = np.concatenate([r.slots, new])

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 63))
    def cache_unfinished(self, i: int) -> None:
        r = self._pick(i)
        present = self._insert(r)
        self.pool.free(r.slots[r.cached_len: max(present, r.cached_len)].copy())
        m = self._check_match(r.key)
        assert len(m.indices) == len(r.key)
        self.cache.inc_lock_ref(m.last_node)
        self.cache.dec_lock_ref(r.node)
        r.slots[:] = m.indices  # the scheduler rewrites the request's row in place
        r.node, r.locked_len = m.last_node, len(r.key)
        r.cached_len = len(r.key)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 63))
    def finish(self, i: int) -> None:
        r = self._pick(i)
        self.live.remove(r)
        present = self._insert(r)
        self.pool.free(r.slots[r.cached_len: max(present, r.cached_len)].copy())
        self.cache.dec_lock_ref(r.node)
        r.slots.fill(0)  # the request's row is reused: the tree must hold its own copy

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 63))
    def abort(self, i: int) -> None:
        r = self._pick(i)
        self.live.remove(r)
        self.pool.free(r.slots[r.cached_len:].copy())
        self.cache.dec_lock_ref(r.node)
        r.slots.fill(0)

    @rule(k=st.integers(0, 64))
    def evict(self, k: int) -> None:
        self._evict(k)

    @rule(key=keys)
    def match(self, key: list[int]) -> None:
        before = self.cache.snapshot(max_key=BIG)
        n = self.cache.prefix_len(key)
        assert self.cache.snapshot(max_key=BIG) == before, "prefix_len changed the tree"
        assert len(self._check_match(key).indices) == n

    @rule(key=keys, tail=st.lists(st.integers(0, 3), max_size=4))
    def walk_on(self, key: list[int], tail: list[int]) -> None:
        """prefix_walk from the hint an earlier walk of this key left (across any inserts, splits, evictions
        and resets since) gives prefix_len, for the key and for the key extended (a waiting request's tokens)."""
        hints = self.hints
        for k in (key, key + tail):
            before = self.cache.snapshot(max_key=BIG)
            n, hint = self.cache.prefix_walk(k, hints.get(tuple(key)))
            assert self.cache.snapshot(max_key=BIG) == before, "prefix_walk changed the tree"
            assert n == longest(self.ref, k) and hint[1] <= n
            if k is key:
                hints[tuple(key)] = hint

    @rule(i=st.integers(0, 63), cut=st.integers(0, 19), tail=st.lists(st.integers(0, 3), max_size=4))
    def match_near(self, i: int, cut: int, tail: list[int]) -> None:
        """Match a cached path cut anywhere and continued: hits mismatches inside nodes and their children."""
        paths = sorted(maximal(self.ref))
        if paths:
            base = paths[i % len(paths)]
            self.match(list(base[: cut % len(base) + 1]) + tail)

    @rule(key=keys)
    def hit(self, key: list[int]) -> None:
        self._hit(key, len(self._check_match(key).indices))

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 63))
    def rematch_live(self, i: int) -> None:
        r = self._pick(i)
        m = self.cache.match_prefix(r.key[: r.cached_len])
        assert np.array_equal(m.indices, r.slots[: r.cached_len])

    @precondition(lambda self: not self.live)
    @rule()
    def flush(self) -> None:  # the scheduler's flush_cache
        self._evict(self.cache.total_size)
        assert self.cache.total_size == 0 and self.pool.available == self.pool.size
        self.cache.reset()
        self.pool.clear()
        self.ref = {}

    # -- invariants --
    @invariant()
    def slots_partitioned(self) -> None:
        """Every slot 1..size is in exactly one place: the pool, the tree, or a live request's own part."""
        own = [s for r in self.live for s in r.slots[r.cached_len:].tolist()]
        tree = tree_slots(self.cache).tolist()
        assert self.pool.available + self.cache.total_size + len(own) == self.pool.size
        where = Counter(pool_free(self.pool)) + Counter(tree) + Counter(own)
        assert where == Counter(range(1, self.pool.size + 1)), "leaked or doubly owned slots"
        for r in self.live:  # a live request's cached part is the tree's own slots
            assert r.slots.tolist()[: r.cached_len] == [self.ref[tuple(r.key[: j + 1])] for j in range(r.cached_len)]

    @invariant()
    def tree_matches_reference(self) -> None:
        assert tree_paths(self.cache) == self.ref
        snap = self.cache.snapshot(max_key=BIG)
        assert snapshot_leaf_paths(snap) == maximal(self.ref)
        seen: set[int] = set()
        for e in snap:
            is_root = e["id"] == self.cache.root.id
            assert (e["parent"] is None) == is_root and (is_root or e["parent"] in seen)  # parent first
            seen.add(e["id"])
            node = self.cache.nodes[e["id"]]
            assert e["lock_ref"] == (0 if is_root else node.lock_ref) and e["key"] == node.key
            assert e["tokens"] == len(node) and e["hit_count"] == node.hit_count
        assert seen == set(self.cache.nodes)

    @invariant()
    def events_replay_to_the_tree(self) -> None:
        """A view that only listens to the events (the tree widget) can rebuild the nodes and their locks."""
        parent, locked = self.ev_parent, self.ev_locked
        for kind, data in self.events.take():
            if kind == "reset":
                parent.clear()
                parent[data["root"]] = None
                locked.clear()
            elif kind == "insert":
                assert data["node"] not in parent and data["parent"] in parent
                parent[data["node"]] = data["parent"]
            elif kind == "split":
                assert parent[data["node"]] == data["parent"] and data["upper"] not in parent
                parent[data["upper"]], parent[data["node"]] = data["parent"], data["upper"]
                if data["node"] in locked:
                    locked.add(data["upper"])
            elif kind == "lock":
                assert not locked & set(data["nodes"])
                locked.update(data["nodes"])
            elif kind == "unlock":
                assert set(data["nodes"]) <= locked
                locked.difference_update(data["nodes"])
            elif kind == "evict":
                for i in data["nodes"]:
                    assert i not in locked and i not in parent.values(), "evicted a locked or inner node"
                    del parent[i]
            elif kind == "hit":
                assert all(i in parent for i in data["nodes"])
            else:
                raise AssertionError(f"unknown event {kind}")
        assert parent == {n.id: n.parent.id if n.parent is not None else None for n in self.cache.nodes.values()}
        assert locked == {n.id for n in self.cache.nodes.values() if n.lock_ref and n is not self.cache.root}

    @invariant()
    def locks_and_sizes(self) -> None:
        cache = self.cache
        assert cache.root.lock_ref == 1
        for r in self.live:
            assert cache.nodes.get(r.node.id) is r.node or r.node is cache.root
            assert node_path(r.node) == tuple(r.key[: r.locked_len])
        locked = [tuple(r.key[: r.locked_len]) for r in self.live]
        protected = evictable = 0
        for node in cache.nodes.values():
            if node is cache.root:
                continue
            path = node_path(node)
            assert node.lock_ref == sum(lp[: len(path)] == path for lp in locked), (path, node.lock_ref)
            if node.lock_ref:
                protected += len(node)
            else:
                evictable += len(node)
        assert (cache.protected_size, cache.evictable_size) == (protected, evictable)


TestRadixMachine = RadixMachine.TestCase
TestRadixMachine.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def test_pool_counts_free_slots_through_many_small_frees():
    """Jump-forward rollbacks free one slot at a time: `available` stays exact and the pending list bounded (it
    was summed on every call, which made the radix cache slower than none on the JSON workload)."""
    from sgnb.engine.kv_pool import PENDING_MERGE

    pool = KVPool(4096)
    taken = [pool.alloc(1) for _ in range(3000)]
    assert pool.available == 4096 - 3000
    for i, slot in enumerate(taken):
        pool.free(slot)
        assert pool.available == 4096 - 3000 + i + 1
        assert len(pool._pending) < PENDING_MERGE
    assert sorted(pool_free(pool)) == list(range(1, 4097))
    assert pool.alloc(4096) is not None and pool.available == 0 and pool.alloc(1) is None


@settings(max_examples=300, deadline=None)
@given(a=st.lists(st.integers(0, 3), max_size=300), b=st.lists(st.integers(0, 3), max_size=300),
       start=st.integers(0, 300), shared=st.integers(0, 200))
def test_common_prefix_len_matches_the_item_by_item_count(a: list[int], b: list[int], start: int, shared: int) -> None:
    b = b[:start] + a[:shared] + b[start:]  # long agreements too, across the 64-item chunks
    start = min(start, len(b))
    want = 0
    while want < min(len(a), len(b) - start) and a[want] == b[start + want]:
        want += 1
    assert radix_cache.common_prefix_len(a, b, start) == want


def test_host_seconds_counts_the_tree_operations() -> None:
    tree = RadixCache(lambda slots: None)
    assert tree.host_seconds == 0.0
    tree.insert(list(range(1000)), np.arange(1000))
    after_insert = tree.host_seconds
    assert after_insert > 0.0
    assert tree.match_prefix(list(range(500))).indices.tolist() == list(range(500))
    assert tree.host_seconds > after_insert


def test_lpm_ranks_long_cached_prefixes_first_and_keeps_arrival_order_below_the_threshold() -> None:
    from sgnb.engine.schedule_policy import LPM_MIN_PREFIX, order_waiting

    tree = RadixCache(lambda slots: None)
    shared = list(range(1000, 1000 + LPM_MIN_PREFIX + 8))
    tree.insert(shared, np.arange(len(shared)))
    tree.insert([7, 8, 9], np.arange(3))

    def fake(name: str, ids: list[int]) -> types.SimpleNamespace:  # what lpm reads of a waiting request
        return types.SimpleNamespace(name=name, fill_ids=ids, origin_input_ids=ids, output_ids=[], lpm_hint=None,
                                     fill_view=lambda: ids)

    reqs = [fake(n, ids) for n, ids in (
        ("fresh", [1, 2, 3]), ("short-hit", [7, 8, 9, 4]), ("long-hit", shared + [5]),
        ("partial", shared[: LPM_MIN_PREFIX] + [6]), ("fresh2", [2, 2]))]
    order = [r.name for r in order_waiting("lpm", reqs, tree)]  # type: ignore[arg-type]
    # a hit of LPM_MIN_PREFIX tokens or more goes first, longest first; a 3-token hit keeps its arrival place
    assert order == ["long-hit", "partial", "fresh", "short-hit", "fresh2"]
    # a second round walks on from each request's hint: the same order, and after an insert that lengthens
    # "fresh"'s hit past the others, that insert counts
    assert [r.name for r in order_waiting("lpm", reqs, tree)] == order  # type: ignore[arg-type]
    tree.insert([1, 2, 3] + list(range(50)), np.arange(53))
    longer = [1, 2, 3] + list(range(50))
    reqs[0].fill_ids = reqs[0].origin_input_ids = longer
    reqs[0].fill_view = lambda: longer
    assert [r.name for r in order_waiting("lpm", reqs, tree)][0] == "fresh"  # type: ignore[arg-type]
    assert [r.name for r in order_waiting("fcfs", reqs, tree)] == [r.name for r in reqs]  # type: ignore[arg-type]
