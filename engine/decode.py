"""Decode rounds of the scheduler (a mixin of Scheduler, on its thread): one decode step for every running request,
the overlap of a step with the host's work on the previous one, making room (eviction, retraction).

Overlap scheduling: a decode step's sampled tokens stay on the device and feed the next step's forward directly;
the host appends them (finish checks, detokenizing, callbacks) while the device runs that next step. So a
request that finishes (EOS, a stop string) is seen one step late: it rides one extra step whose KV is real (its
last token's) and whose token is dropped. Only plain decode continues this way: anything that needs the previous
token on the host first (a grammar mask, penalties, min_new_tokens, a prefill, admission, aborts, retraction)
waits for it (`_resolve_pending`), and the next step runs as before.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from sgnb.engine.forward_batch import BatchSpec, to_device
from sgnb.engine.request import Req, ReqStatus
from sgnb.engine.sampler import DeviceSample, SampleOutput, sample_on_device

if TYPE_CHECKING:
    from sgnb.engine.scheduler import Scheduler

log = logging.getLogger("sgnb.engine")


class DecodeRounds:
    """Scheduler's decode rounds: `_run_decode` steps every running request, overlapped where it can be."""

    _pending: PendingStep | None  # a decode step whose tokens are still on the device (Scheduler sets it)

    def _run_decode(self: Scheduler) -> None:
        t0 = time.perf_counter()
        self._decode_round()
        self.counters.decode_seconds += time.perf_counter() - t0

    def _decode_round(self: Scheduler) -> None:
        self._make_room_for_decode()
        reqs = self._with(ReqStatus.RUNNING)
        if not reqs:
            return
        graphs = self.runner.graphs
        if graphs is None or not graphs.fits(len(reqs)):  # a graph replay reads whole key ranges: no groups
            order, groups = self._groups(reqs)
            reqs = [reqs[i] for i in order]
        else:
            groups = None
        t0 = self._now()
        spec = self._decode_spec(reqs, [r.output_ids[-1] for r in reqs], groups=groups)
        self._phase("build", t0)
        hidden = self._forward(spec, reqs)
        if hidden is None:
            return
        self.counters.decode_steps += 1
        for r in reqs:
            r.kv_len += 1
        if not (self.overlap and all(overlap_ok(r) for r in reqs) and self._launch(reqs, hidden)):
            self._sample_and_advance(reqs, hidden, None)
        self.new_token_ratio = max(self.new_token_ratio - 0.002, self.config.min_new_token_ratio)

    def _launch(self: Scheduler, reqs: list[Req], hidden: Any) -> bool:
        """Sample this step on the device and leave it pending. False when sampling raised (the caller then
        samples synchronously, request by request)."""
        t0 = self._now()
        try:
            with self.device_time.span():
                out = sample_on_device(self.runner.logits(hidden, None), reqs, self.eos_ids, self.generator)
        except Exception:
            return False
        finally:
            self._phase("sample", t0)
        self._pending = PendingStep(reqs, out)
        return True

    def _overlap_batch(self: Scheduler) -> list[Req] | None:
        """The next decode batch if it can start before the pending step is on the host, else None: every
        running request was in the pending step, nothing waits to be admitted, aborted or flushed, each
        request is plainly decoding and the KV pool has a slot for each."""
        pending = self._pending
        if (pending is None or self.waiting or self._aborts or self._pending_flush or not self.inbox.empty()
                or any(r.status is not ReqStatus.RUNNING for r in self.active)):
            return None
        members = pending.index
        running = self.active
        if any(id(r) not in members for r in running):
            return None
        ctx = self.runner.context_length
        # a request whose pending token ends it by length finishes when resolved: not in the next step
        nxt = [r for r in running if len(r.output_ids) + 1 < r.sampling.max_new_tokens]
        if not nxt or any(not overlap_ok(r) or r.kv_len + 2 >= ctx for r in nxt):
            return None
        short = len(nxt) - self.kv_pool.available
        if short > 0:
            self.tree.evict(short)
            if len(nxt) > self.kv_pool.available:
                return None
        return nxt

    def _decode_overlapped(self: Scheduler, reqs: list[Req]) -> None:
        """Launch the next decode step (`reqs`, from _overlap_batch) over the pending step's tokens (still on the
        device), then bring the pending step to the host while the device runs the new one."""
        prev = self._pending
        assert prev is not None
        pick = [prev.index[id(r)] for r in reqs]
        ids = prev.out.chosen if pick == list(range(len(prev.reqs))) else \
            prev.out.chosen[to_device(pick, torch.int64, prev.out.chosen.device)]
        spec = self._decode_spec(reqs, [0] * len(reqs), input_ids_device=ids)
        hidden = self._forward(spec, reqs)
        self._pending = None
        if hidden is None:  # the forward failed: those requests failed; the earlier step still lands
            self._advance(prev.reqs, prev.out.to_host())
            return
        self.counters.decode_steps += 1
        self.counters.overlapped_steps += 1
        for r in reqs:
            r.kv_len += 1
        launched = self._launch(reqs, hidden)
        self._advance(prev.reqs, self._to_host(prev.out))  # the host's work, while the device runs this step
        if not launched:
            live = [r for r in reqs if not r.finished]
            if live:
                self._sample_and_advance(live, hidden, [reqs.index(r) for r in live])
        self.new_token_ratio = max(self.new_token_ratio - 0.002, self.config.min_new_token_ratio)

    def _resolve_pending(self: Scheduler) -> None:
        """Bring the pending decode step's tokens to the host and advance its requests."""
        prev, self._pending = self._pending, None
        if prev is not None:
            t0 = time.perf_counter()
            self._advance(prev.reqs, self._to_host(prev.out))
            self.counters.decode_seconds += time.perf_counter() - t0

    def _to_host(self: Scheduler, out: DeviceSample) -> SampleOutput:
        t0 = self._now()
        host = out.to_host()
        self._phase("sample", t0)
        return host

    def _decode_spec(self: Scheduler, reqs: list[Req], input_ids: list[int], groups: Any = None,
                     input_ids_device: torch.Tensor | None = None) -> BatchSpec:
        """One new KV slot per request (room was ensured), written into their rows, and the decode batch over
        them. Host work only: the rows' new entries reach the device with the forward (ReqToTokenPool.sync_device)."""
        slots = self.kv.alloc(len(reqs))
        assert slots is not None, "decode room was ensured"
        self.kv.write_next(reqs, slots)
        rows, kv_lens = [r.req_pool_idx for r in reqs], [r.kv_len for r in reqs]
        return BatchSpec(input_ids=input_ids, out_cache_loc=slots, req_pool_indices=rows,  # type: ignore[arg-type]
                         prefix_lens=kv_lens, extend_lens=[1] * len(reqs), groups=groups,
                         input_ids_device=input_ids_device)

    def _make_room_for_decode(self: Scheduler) -> None:
        running = self._with(ReqStatus.RUNNING)
        short = len(running) - self.kv_pool.available
        if short > 0:
            self.tree.evict(short)
        # retract the requests with the most work left until one slot per request fits
        while running and len(running) > self.kv_pool.available:
            victim = max(running, key=lambda r: (r.remaining_new_tokens(), -len(r.output_ids)))
            running.remove(victim)
            self._retract(victim)
            self.tree.evict(len(running) - self.kv_pool.available)

    def _retract(self: Scheduler, req: Req) -> None:
        self.kv.release(req, cache=True)
        self.active.remove(req)
        req.status = ReqStatus.WAITING
        req.num_retractions += 1
        self.counters.retractions += 1
        self.waiting.insert(0, req)
        self.new_token_ratio = min(1.0, self.new_token_ratio + 0.1)
        self.events.emit("request", {"rid": req.rid, "state": "retracted"})


class PendingStep:
    """A decode step whose sampled tokens are still on the device (overlap scheduling)."""

    def __init__(self, reqs: list[Req], out: DeviceSample) -> None:
        self.reqs = reqs
        self.out = out
        self.index = {id(r): i for i, r in enumerate(reqs)}


def overlap_ok(req: Req) -> bool:
    """Whether a request's next token can be sampled before its previous one is on the host: nothing in its
    sampling reads its output so far (a grammar, penalties, a min_new_tokens ban still in force)."""
    sp = req.sampling
    return (req.grammar is None and req.grammar_held is None and sp.repetition_penalty == 1.0 and not sp.frequency_penalty
            and not sp.presence_penalty and len(req.output_ids) >= sp.min_new_tokens)

