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

RESERVE_CLIP = 4096  # never reserve decode room for more than this many tokens of one request


def reserve(req: Req, new_token_ratio: float) -> int:
    """Decode room to keep for a request that will generate its remaining tokens."""
    return int(min(max(req.remaining_new_tokens(), 0), RESERVE_CLIP) * new_token_ratio)


@dataclass
class PrefillItem:
    req: Req
    extend: int  # tokens this round computes, from req.kv_len
    rider: bool = False  # a running request's decode step riding along (its one new token)


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
        left = len(req.fill_ids) - req.kv_len
        ext = min(left, self.budget, self.config.chunked_prefill_size) if chunk else left
        if ext <= 0 or ext > self.budget or not self.kv.alloc_extend(req, ext):
            return False
        self._take(req, ext, finishes=ext == left)
        return True

    def add_new(self, req: Req) -> Added:
        """A waiting request: match its cached prefix, lock it, allocate the rest (or its first chunk)."""
        fill = req.fill_ids
        match = self.tree.match_prefix(fill)
        prefix = min(len(match.indices), len(fill) - 1)  # compute at least one token: its logits
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
        can be had without evicting: they need not wait for the prefill round to end."""
        for req in running:
            if self.kv.kv_pool.available < 1 or not self.kv.alloc_extend(req, 1):
                return
            self.items.append(PrefillItem(req, 1, rider=True))

    def _take(self, req: Req, ext: int, finishes: bool) -> None:
        self.items.append(PrefillItem(req, ext))
        self.budget -= ext
        if finishes:
            self.reserved += reserve(req, self.ratio)
        else:
            self.chunked = req
