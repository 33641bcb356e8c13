"""Admission: which requests join this round's prefill batch, within its token and KV budgets.

A request joins when its new tokens fit the round's token budget (`max_prefill_tokens`; a prompt longer than
`chunked_prefill_size`, or than what is left, is cut into chunks, one chunked request at a time) and when the KV
it needs fits what can be had (free + evictable slots) minus the decode growth reserved for running requests
(`reserve`: a share of each one's remaining max_new_tokens).

Nothing is computed twice in one round. A waiting request whose uncached tokens start like those of a new prompt
already in this batch (one that this round computes to its end, from the same position) borrows them: its table
row points at that request's new slots, which the forward fills before any attention reads them, and it computes
only the rest (at least its last token, for its logits). After the forward the lender's prompt is in the tree and
the borrower locks it there (`KVManager.adopt`). So 200 copies of a short prompt arriving together cost one
prompt's compute, in the same round. A request whose uncached prefix a *chunked* prompt is computing waits one
round instead (`in_batch_prefix_threshold` tokens or longer), to hit the cache.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from sgnb.engine.config import EngineConfig
from sgnb.engine.kv_manager import KVManager
from sgnb.engine.radix_cache import RadixCache, common_prefix_len
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
    # 0, or 1 + the largest depth of the requests it borrows tokens from: after the forward, items are
    # finished in increasing depth (a lender has cached its tokens before its borrowers adopt them)
    depth: int = 0


class _Piece(NamedTuple):
    slots: np.ndarray  # a lender's new slots for the borrowed positions
    depth: int  # the lender's depth


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
        assert config.chunked_prefill_size is not None, "the engine resolves the device's default at start"
        self.chunk_size: int = config.chunked_prefill_size
        self.reserved = reserved
        self.ratio = new_token_ratio
        self.items: list[PrefillItem] = []
        self.chunked: Req | None = None  # the request this batch leaves unfinished, if any
        self._deferred: set[tuple] = set()
        # requests this round computes to their end, with their items' depth, by (first computed position, its
        # token): lenders
        self._lenders: dict[tuple[int, int], list[tuple[Req, int]]] = {}

    @property
    def full(self) -> bool:
        return self.budget <= 0

    def add_continuation(self, req: Req, chunk: bool) -> bool:
        """An admitted request's next tokens (it already holds its row, prefix and lock): all of them, or with
        chunk=True at most a chunk. False when they do not fit now."""
        left = req.fill_len - req.kv_len
        ext = min(left, self.budget, self.chunk_size) if chunk else left
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
        reuse_end = len(fill) - 1  # compute at least one token: its logits
        if not req.input_logprobs_done:
            reuse_end = min(reuse_end, max(req.logprob_start_len - 1, 0))
        prefix = min(cached, reuse_end)
        pieces = self._borrowable(req, fill, prefix, reuse_end)
        borrow = sum(len(p.slots) for p in pieces)
        total = len(fill) - prefix - borrow
        threshold = self.config.in_batch_prefix_threshold
        if not borrow and not self.tree.disable and total > threshold:
            key = (prefix, tuple(fill[prefix: prefix + threshold]))
            if key in self._deferred:
                return Added.SKIP
            self._deferred.add(key)
        ext = min(total, self.budget, self.chunk_size)
        if ext < total and self.chunked is not None:
            return Added.SKIP
        need = ext + (reserve(req, self.ratio) if ext == total else 0)
        if need > self.kv.available - self.reserved:
            return Added.STOP
        match = self.tree.match_prefix(fill)
        assert len(match.indices) == cached, (len(match.indices), cached)
        if not self.kv.admit(req, match, prefix):
            return Added.STOP
        for piece in pieces:
            self.kv.borrow(req, piece.slots)
        if not self.kv.alloc_extend(req, ext):
            self.kv.release(req, cache=False)
            return Added.STOP
        if prefix:
            self.tree.record_hit(match.last_node, req.rid)
        depth = 1 + max((p.depth for p in pieces), default=-1)
        self._take(req, ext, finishes=ext == total, depth=depth)
        if ext == total and not req.mm and not self.tree.disable:
            start = req.kv_len
            self._lenders.setdefault((start, fill[start]), []).append((req, depth))
        return Added.YES

    def _borrowable(self, req: Req, fill: list[int], start: int, end: int) -> list[_Piece]:
        """What of fill[start:end] requests of this batch compute this round, from `start` on without a gap:
        at each position the lender that agrees longest from there, then on from where it stops agreeing
        (prompts that share a first token and then differ still lend what follows to their own copies)."""
        pieces: list[_Piece] = []
        if req.mm or not self._lenders or self.config.disable_in_batch_sharing:
            return pieces
        pos = start
        while pos < end:
            best, run = None, 0
            head = None
            for other, depth in self._lenders.get((pos, fill[pos]), ()):
                theirs = other.fill_view()
                if head is None:
                    head = fill[:pos]
                if theirs[:pos] != head:  # K/V depend on every earlier token: the same ones, or nothing to share
                    continue
                n = min(common_prefix_len(theirs[pos: other.fill_len], fill, pos), end - pos)
                if n > run:
                    best, run = _Piece(other.new_slots[:n], depth), n  # type: ignore[index]
            if best is None:
                break
            pieces.append(best)
            pos += run
        return pieces

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

    def _take(self, req: Req, ext: int, finishes: bool, forced: bool = False, depth: int = 0) -> None:
        self.items.append(PrefillItem(req, ext, forced=forced, depth=depth))
        self.budget -= ext
        if finishes:
            self.reserved += reserve(req, self.ratio)
        else:
            self.chunked = req
