"""Admission: which requests join this round's prefill batch, within its token and KV budgets.

A request joins when its new tokens fit the round's token budget (`max_prefill_tokens`; a prompt longer than
`chunked_prefill_size`, or than what is left, is cut into chunks, one chunked request at a time) and when the KV
it needs fits what can be had (free + evictable slots) minus the decode growth reserved for running requests
(`reserve`: a share of each one's remaining max_new_tokens). A waiting request whose uncached prefix another
request in this batch is computing right now waits one round, to hit the cache instead of computing it twice.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from sgnb.engine.config import EngineConfig
from sgnb.engine.kv_manager import KVManager
from sgnb.engine.radix_cache import RadixCache
from sgnb.engine.request import Req
from sgnb.engine.schedule_policy import cached_prefix_len

RESERVE_CLIP = 4096  # never reserve decode room for more than this many tokens of one request


def reserve(req: Req, new_token_ratio: float) -> int:
    """Decode room to keep for a request that will generate its remaining tokens."""
    return int(min(max(req.remaining_new_tokens(), 0), RESERVE_CLIP) * new_token_ratio)


@dataclass
class PrefillItem:
    req: Req
    extend: int  # tokens this round computes, from req.kv_len
    rider: bool = False  # a running request's decode step riding along (its one new token)
    forced: bool = False  # a jump-forward continuation: the grammar's forced tokens after generated ones


class Added(enum.Enum):
    YES = "yes"
    SKIP = "skip"  # not this one (deferred, or one chunked request already): try the next
    STOP = "stop"  # out of budget or KV: nothing after it fits either


class PrefillAdder:
    def __init__(self, config: EngineConfig, kv: KVManager, tree: RadixCache, reserved: int,
                 new_token_ratio: float) -> None:
        self.config = config
        self.kv = kv
        self.tree = tree
        self.budget = config.max_prefill_tokens
        self.reserved = reserved
        self.ratio = new_token_ratio
        self.items: list[PrefillItem] = []
        self.chunked: Req | None = None  # the request this batch leaves unfinished, if any
        self._deferred: set[tuple] = set()

    @property
    def full(self) -> bool:
        return self.budget <= 0

    def add_continuation(self, req: Req, chunk: bool) -> bool:
        """An admitted request's next tokens (it already holds its row, prefix and lock): all of them, or with
        chunk=True at most a chunk. False when they do not fit now."""
        left = req.fill_len - req.kv_len
        ext = min(left, self.budget, self.config.chunked_prefill_size) if chunk else left
        if ext <= 0 or ext > self.budget or not self.kv.alloc_extend(req, ext):
            return False
        self._take(req, ext, finishes=ext == left, forced=not chunk)
        return True

    def add_new(self, req: Req) -> Added:
        """A waiting request: match its cached prefix, lock it, allocate the rest (or its first chunk)."""
        fill = req.fill_view()
        # how much is cached, without touching the tree (walking on from this request's earlier walks): most
        # requests tried in a busy round are skipped or do not fit, and match_prefix would split nodes for them
        cached = cached_prefix_len(self.tree, req)
        prefix = min(cached, len(fill) - 1)  # compute at least one token: its logits
        if not req.input_logprobs_done:
            prefix = min(prefix, max(req.logprob_start_len - 1, 0))
        total = len(fill) - prefix
        threshold = self.config.in_batch_prefix_threshold
        if not self.tree.disable and total > threshold:
            key = (prefix, tuple(fill[prefix: prefix + threshold]))
            if key in self._deferred:
                return Added.SKIP
            self._deferred.add(key)
        ext = min(total, self.budget, self.config.chunked_prefill_size)
        if ext < total and self.chunked is not None:
            return Added.SKIP
        need = ext + (reserve(req, self.ratio) if ext == total else 0)
        if need > self.kv.available - self.reserved:
            return Added.STOP
        match = self.tree.match_prefix(fill)
        assert len(match.indices) == cached, (len(match.indices), cached)
        if not self.kv.admit(req, match, prefix):
            return Added.STOP
        if not self.kv.alloc_extend(req, ext):
            self.kv.release(req, cache=False)
            return Added.STOP
        if prefix:
            self.tree.record_hit(match.last_node, req.rid)
        self._take(req, ext, finishes=ext == total)
        return Added.YES

    def add_riders(self, running: list[Req]) -> None:
        """Running requests decode their next token in this batch too (a mixed batch), as long as a slot each
        can be had without evicting: they need not wait for the prefill round to end. Their slots are taken and
        written into their rows at once (a decode step's way: one write for all, not one per request)."""
        riders = running[: self.kv.kv_pool.available]
        if not riders:
            return
        slots = self.kv.kv_pool.alloc(len(riders))
        if slots is None:
            return
        self.kv.write_next(riders, slots)
        for i, req in enumerate(riders):
            req.new_slots = slots[i: i + 1]
            self.items.append(PrefillItem(req, 1, rider=True))

    def _take(self, req: Req, ext: int, finishes: bool, forced: bool = False) -> None:
        self.items.append(PrefillItem(req, ext, forced=forced))
        self.budget -= ext
        if finishes:
            self.reserved += reserve(req, self.ratio)
        else:
            self.chunked = req
