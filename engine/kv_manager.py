"""KV ownership: who owns every slot of the pool, and the operations that move slots between owners.

Every slot 1..size is exactly one of: free (in the KVPool's free list), owned by the radix tree (a node's value),
or owned by a live request (its computed tokens past `cached_len` that are not in the tree yet). So
`free + tree + owned by requests == pool size` always holds; `check` asserts it. A request's first `cached_len`
slots are the tree's, protected by the lock on `req.last_node`; the next `borrowed` (0 but in the round it
was admitted in) belong to another request of that round's batch (see `borrow`); the rest, up to `kv_len`, are
its own.

Only the scheduler thread calls these (none is thread-safe).
"""

from __future__ import annotations

import numpy as np

from sgnb.engine.kv_pool import KVPool, ReqToTokenPool
from sgnb.engine.radix_cache import MatchResult, RadixCache, TreeNode
from sgnb.engine.request import Req


class KVManager:
    def __init__(self, kv_pool: KVPool, req_pool: ReqToTokenPool, tree: RadixCache) -> None:
        self.kv_pool = kv_pool
        self.req_pool = req_pool
        self.tree = tree

    @property
    def available(self) -> int:
        """Slots that can be had now: free, or held by unlocked tree nodes (evictable)."""
        return self.kv_pool.available + self.tree.evictable_size

    def alloc(self, n: int) -> np.ndarray | None:
        """n free slots, evicting least-recently-used tree leaves if needed; None when even that is short."""
        slots = self.kv_pool.alloc(n)
        if slots is None:
            self.tree.evict(n - self.kv_pool.available)
            slots = self.kv_pool.alloc(n)
        return slots

    def admit(self, req: Req, match: MatchResult, prefix: int) -> bool:
        """Give a waiting request a table row that starts with the first `prefix` matched slots, locked.
        False (nothing changed) when no row is free."""
        row = self.req_pool.alloc()
        if row is None:
            return False
        req.req_pool_idx = row
        self.tree.inc_lock_ref(match.last_node)
        req.last_node = match.last_node
        if prefix:
            self.req_pool.write(row, 0, match.indices[:prefix])
        req.kv_len = req.cached_len = prefix
        return True

    def borrow(self, req: Req, slots: np.ndarray) -> None:
        """The request's next positions (from kv_len) read `slots`: new slots of another request in the same
        prefill batch, for the same tokens at the same positions. The forward stores every new token's K/V
        before any attention reads the pool, so they hold the right values when this request reads them. The
        lender owns them; after the forward it has put them in the tree and `adopt` locks them there."""
        assert req.req_pool_idx is not None and req.kv_len == req.cached_len + req.borrowed
        self.req_pool.write(req.req_pool_idx, req.kv_len, slots)
        req.kv_len += len(slots)
        req.borrowed += len(slots)

    def adopt(self, req: Req) -> None:
        """After the forward: the borrowed tokens are in the tree (their lender cached its prompt); point the
        row at the tree's slots for them (the lender's, unless the tree had a copy first) and move the lock
        there. Raises, with nothing changed, when they are not in the tree (the lender failed): the caller
        fails the request, whose release then frees only its own slots."""
        n = req.cached_len + req.borrowed
        assert req.req_pool_idx is not None  # admitted: it holds a row
        match = self.tree.match_prefix(req.fill_view()[:n])
        if len(match.indices) < n:
            raise RuntimeError("the request of this batch whose prompt this one shared failed before caching it")
        self.req_pool.write(req.req_pool_idx, req.cached_len, match.indices[req.cached_len: n])
        self.tree.inc_lock_ref(match.last_node)
        if req.last_node is not None:
            self.tree.dec_lock_ref(req.last_node)
        req.last_node = match.last_node
        req.cached_len, req.borrowed = n, 0

    def alloc_extend(self, req: Req, n: int) -> bool:
        """Slots for the request's next n tokens (positions kv_len ..), written into its row and kept in
        req.new_slots until the forward; the request owns them. False (nothing changed) when short."""
        slots = self.alloc(n)
        if slots is None:
            return False
        assert req.req_pool_idx is not None
        self.req_pool.write(req.req_pool_idx, req.kv_len, slots)
        req.new_slots = slots
        return True

    def write_next(self, reqs: list[Req], slots: np.ndarray) -> None:
        """slots[i] becomes position kv_len of reqs[i]'s row (one new token each: a decode step, or riders)."""
        rows = [r.req_pool_idx for r in reqs]  # every one admitted: none is None
        self.req_pool.write_points(rows, [r.kv_len for r in reqs], slots)  # type: ignore[arg-type]

    def cache_unfinished(self, req: Req) -> None:
        """Hand the computed prefix of a live request to the tree so others can share it; keep it locked."""
        if self.tree.disable:
            return
        row = req.req_pool_idx
        assert row is not None  # admitted: it holds a row
        slots = self.req_pool.table[row, : req.kv_len]  # a view: the tree copies what it adopts
        key = req.fill_ids[: req.kv_len]
        present, node = self.tree.insert_path(key, slots, req.rid)
        if present > req.cached_len:  # someone else cached these first: drop our copies, read the tree's
            self.kv_pool.free(slots[req.cached_len: present].copy())
            match = self.tree.match_prefix(key)
            assert len(match.indices) == req.kv_len and match.last_node is node
            self.req_pool.write(row, 0, match.indices)
        # else the row already holds the tree's slots: its cached prefix came from the tree, the rest went in
        self.tree.inc_lock_ref(node)
        if req.last_node is not None:
            self.tree.dec_lock_ref(req.last_node)
        req.last_node = node
        req.cached_len = req.kv_len

    def release(self, req: Req, cache: bool) -> None:
        """Give back the request's row, its own KV slots (to the tree when cache) and its lock."""
        row = req.req_pool_idx
        if row is None:
            return
        slots = self.req_pool.table[row, : req.kv_len].copy()
        own_from = req.cached_len + req.borrowed
        if cache and not self.tree.disable and req.kv_len > 0:
            own_until = self.tree.insert(req.fill_ids[: req.kv_len], slots, req.rid)
            self.kv_pool.free(slots[own_from: max(own_until, own_from)])
        else:
            self.kv_pool.free(slots[own_from:])
        if req.last_node is not None:
            self.tree.dec_lock_ref(req.last_node)
        self.req_pool.free(row)
        req.req_pool_idx, req.last_node, req.kv_len, req.cached_len, req.borrowed = None, None, 0, 0, 0
        req.rollback_floor = 0

    def truncate(self, req: Req, kv_len: int) -> None:
        """Drop the request's K/V past position kv_len (its own slots only: kv_len >= cached_len)."""
        assert req.cached_len + req.borrowed <= kv_len <= req.kv_len, (req.cached_len, kv_len, req.kv_len)
        self.kv_pool.free(self.req_pool.table[req.req_pool_idx, kv_len: req.kv_len].copy())
        req.kv_len = kv_len

    def shared_prefix_len(self, reqs: list[Req]) -> int:
        """How many leading slots all these requests share: the tree path common to their locked nodes,
        within what each of them uses of it (host only: no device read)."""
        if len(reqs) < 2:
            return 0
        nodes = [r.last_node for r in reqs]
        if any(n is None for n in nodes):
            return 0
        limit = min(r.cached_len for r in reqs)
        return min(self.tree.common_prefix_depth(nodes), limit)

    def group_by_prefix(self, reqs: list[Req], min_shared: int) -> tuple[list[int], list[tuple[int, int, int]]]:
        """Group requests that share at least `min_shared` leading slots (their locked tree nodes' common path):
        returns an order of `reqs` (indices) that makes each group contiguous, and the groups as (first position
        in that order, count, shared slots), every request in one group (a lone one: shared 0). Requests are
        grouped by the first tree node at depth >= min_shared on their path; a group's shared length is its
        members' common path, within what each uses of it. Host only."""
        by_anchor: dict[int, list[int]] = {}
        alone: list[int] = []
        for i, r in enumerate(reqs):
            anchor = self._anchor(r.last_node, min_shared) if r.cached_len >= min_shared else None
            if anchor is None:
                alone.append(i)
            else:
                by_anchor.setdefault(anchor, []).append(i)
        order: list[int] = []
        groups: list[tuple[int, int, int]] = []
        for members in by_anchor.values():
            if len(members) < 2:
                alone.extend(members)
                continue
            shared = min(self.tree.common_prefix_depth([reqs[i].last_node for i in members]),
                         min(reqs[i].cached_len for i in members))
            groups.append((len(order), len(members), shared))
            order.extend(members)
        for i in sorted(alone):
            groups.append((len(order), 1, 0))
            order.append(i)
        return order, groups

    def _anchor(self, node: TreeNode | None, min_depth: int) -> int | None:
        """Id of the first node on the root..node path whose depth (in tokens) reaches min_depth."""
        path = []
        while node is not None and node is not self.tree.root:
            path.append(node)
            node = node.parent
        depth = 0
        for n in reversed(path):
            depth += len(n)
            if depth >= min_depth:
                return n.id
        return None

    def owned(self, reqs: list[Req]) -> int:
        return sum(r.kv_len - r.cached_len - r.borrowed for r in reqs if r.req_pool_idx is not None)

    def check(self, reqs: list[Req]) -> None:
        """Assert free + tree + owned by `reqs` (every live request) == pool size."""
        free, tree, owned = self.kv_pool.available, self.tree.total_size, self.owned(reqs)
        assert free + tree + owned == self.kv_pool.size, (
            f"KV accounting broken: free {free} + tree {tree} + owned {owned} != pool {self.kv_pool.size}")
