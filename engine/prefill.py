"""Prefill rounds of the scheduler (a mixin of Scheduler, on its thread): admission of a prefill batch, attaching
grammars, the forward of new tokens (chunks of long prompts, media rows, mixed decode riders), prompt logprobs.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from sgnb.engine.admission import Added, PrefillAdder, PrefillItem, reserve
from sgnb.engine.decode import overlap_ok
from sgnb.engine.forward_batch import BatchSpec, HostCopy
from sgnb.engine.media import PLACEHOLDER_ID, is_pad
from sgnb.engine.request import Req, ReqStatus
from sgnb.engine.sampler import DeviceSample, sample_on_device
from sgnb.engine.schedule_policy import order_waiting

if TYPE_CHECKING:
    from sgnb.engine.scheduler import Scheduler

log = logging.getLogger("sgnb.engine")
LOGITS_CHUNK = 256  # rows of (rows, vocab) logits materialized at once for input logprobs


class PrefillRounds:
    """Scheduler's prefill rounds: `_admit` picks the batch, `_run_prefill` computes it (`_launch_prefill`, then
    `_resolve_prefill` at once, or after the next batch's launch under overlap_prefill)."""

    _pending_prefill: PendingPrefill | None  # a launched batch whose results are still on the device (Scheduler sets it)

    def _admit(self: Scheduler, new_only: bool = False) -> list[PrefillItem]:
        """Pick the next prefill batch, lock its prefixes and allocate its KV. Empty when nothing fits.
        new_only: waiting requests only (no continuation of an admitted one, no decode riders)."""
        if not self.waiting and (new_only or not any(r.status is not ReqStatus.RUNNING for r in self.active)):
            return []
        running = self._with(ReqStatus.RUNNING)
        adder = PrefillAdder(self.config, self.kv, self.tree, sum(reserve(r, self.new_token_ratio) for r in running),
                             self.new_token_ratio)
        for req in [] if new_only else self._with(ReqStatus.EXTENDING):  # jump-forward continuations: they
            if not adder.add_continuation(req, chunk=False):  # hold their KV already
                break
        chunked = [] if new_only else self._with(ReqStatus.CHUNKED)  # a long prompt in progress goes before new ones
        stuck = bool(chunked) and not adder.add_continuation(chunked[0], chunk=True)
        compiling = False
        admitted: list[Req] = []
        for req in [] if stuck else order_waiting(self.config.schedule_policy, self.waiting, self.tree):
            if adder.full or len(self.active) + len(admitted) >= self.config.max_running_requests:
                break
            if (req.grammar_future is not None and req.grammar is None and req.grammar_held is None
                    and not self._attach_grammar(req)):
                compiling = True
                continue  # still compiling (or failed)
            added = adder.add_new(req)
            if added is Added.STOP:
                break
            if added is Added.YES:
                admitted.append(req)
                if req.cached_tokens < 0:  # prompt tokens served from the cache or by a request of this batch
                    # (not a forced opening after the prompt)
                    req.cached_tokens = min(req.cached_len + req.borrowed, len(req.origin_input_ids))
                    self.counters.cached_tokens += req.cached_tokens
        if admitted:
            ids = {id(r) for r in admitted}
            self.waiting = [r for r in self.waiting if id(r) not in ids]
            for r in admitted:
                r.lpm_hint = None
            self.active.extend(admitted)
        for item in adder.items:  # what each request does after this round
            done = item.req.kv_len + item.extend == item.req.fill_len
            item.req.status = ReqStatus.RUNNING if done else ReqStatus.CHUNKED
        if adder.items and running and not new_only and not self.config.disable_mixed_batches:
            adder.add_riders(running)
        if not adder.items and self.waiting and not self.active and not compiling:
            # nothing runs and nothing will free memory: the head request can never fit
            req = self.waiting.pop(0)
            self._fail(req, MemoryError(
                f"request needs more KV cache than the pool holds ({self.kv_pool.size} tokens)"))
        return adder.items

    def _attach_grammar(self: Scheduler, req: Req) -> bool:
        """Give an admitted request its matcher once its grammar compiled; force the grammar's fixed opening
        (e.g. '{"name": "') into the output before the first prefill."""
        fut = req.grammar_future
        if not fut.done():
            return False
        try:
            matcher = self.grammar().matcher(fut.result())
        except Exception as e:
            self._fail(req, e)
            return False
        if req.sampling.grammar_after:  # free text (the reasoning) first: finishing.py starts it at the marker
            req.grammar_held = matcher
            return True
        req.grammar = matcher
        if not self.config.disable_jump_forward and not req.output_ids:
            from sgnb.engine.grammar import jump_forward

            jf = jump_forward(req.grammar, [], self.tokenizer, max_growth=req.remaining_new_tokens() - 1)
            if jf is not None:
                self._append_forced(req, jf.forced_ids)
        return True

    def _append_forced(self: Scheduler, req: Req, ids: list[int]) -> None:
        req.output_ids.extend(ids)
        req.forced.extend([True] * len(ids))
        if req.return_logprob:  # not sampled: no distribution was consulted
            req.output_token_logprobs.extend((None, t) for t in ids)
            req.output_top_logprobs.extend([None] * len(ids))

    def _run_prefill(self: Scheduler, batch: list[PrefillItem]) -> None:
        """Compute a prefill batch; its results are read at once, or left pending (see `_hold_or_resolve`)."""
        self._hold_or_resolve(self._launch_prefill(batch))

    def _hold_or_resolve(self: Scheduler, pending: PendingPrefill | None) -> None:
        """Leave a launched prefill batch pending while the next one starts, or read it now. Pending only with
        overlap_prefill on, nothing left that reads its hidden states when resolved (the next forward may
        overwrite them: a CUDA graph's static output), and nothing else waiting for the host."""
        if pending is None:
            return
        if (self.overlap_prefill and not pending.reads_hidden and self._pending is None and not self._aborts
                and not self._pending_flush):
            self._pending_prefill = pending
        else:
            self._resolve_prefill(pending)

    def _overlap_prefill_batch(self: Scheduler, pending: PendingPrefill) -> list[PrefillItem]:
        """The next prefill batch to launch while `pending` is: newly arrived requests only. Empty when there are
        none or they do not fit, and whenever an admitted request outside the pending batch waits for a round (a
        decode step, its prompt's next chunk, a jump-forward continuation): the scheduler then reads the pending
        batch and runs its usual round, so a stream of arrivals cannot starve them."""
        if not self.waiting or self._aborts or self._pending_flush or self._pending is not None:
            return []
        if any(id(r) not in pending.members for r in self.active):
            return []
        return self._admit(new_only=True)

    def _launch_prefill(self: Scheduler, batch: list[PrefillItem]) -> PendingPrefill | None:
        """Build and launch a prefill batch: the forward, its prompt logprobs and its first tokens' sampling on
        the device, and the host's bookkeeping that needs no result (KV lengths, the tree). The results are
        read by `_resolve_prefill`."""
        t0 = self._now()
        batch, features = self._encode_media(batch)
        if not batch:
            return None
        order, groups = self._groups([item.req for item in batch])
        batch = [batch[i] for i in order]  # requests sharing a cached prefix side by side
        reqs = [item.req for item in batch]
        ids: list[int] = []
        mm_rows: list[int] = []
        mm_parts: list[torch.Tensor] = []
        for item in batch:
            r = item.req
            lo, hi = r.kv_len, r.kv_len + item.extend
            for p in r.mm:  # the part of each image inside this chunk: placeholder ids, the features' rows
                a, b = max(lo, p.offset), min(hi, p.end)
                if a < b:
                    mm_rows.extend(range(len(ids) + a - lo, len(ids) + b - lo))
                    mm_parts.append(features[p.item.hash][a - p.offset: b - p.offset])
            chunk = r.fill_slice(lo, hi)
            ids.extend((t if not is_pad(t) else PLACEHOLDER_ID for t in chunk) if r.mm else chunk)
        slots = [r.new_slots for r in reqs if r.new_slots is not None]
        pool_rows = [r.req_pool_idx for r in reqs if r.req_pool_idx is not None]
        assert len(slots) == len(pool_rows) == len(reqs)  # admitted, with slots for this forward
        spec = BatchSpec(
            input_ids=ids,
            out_cache_loc=np.concatenate(slots),
            req_pool_indices=pool_rows,
            prefix_lens=[r.kv_len for r in reqs],
            extend_lens=[item.extend for item in batch],
            groups=groups,
            mm_rows=mm_rows or None,
            mm_embeds=torch.cat(mm_parts) if mm_parts else None,
        )
        self._phase("build", t0)
        hidden = self._forward(spec, reqs)
        if hidden is None:
            return None
        t0 = self._now()
        self.counters.prefill_batches += 1
        self.counters.prefill_tokens += spec.num_tokens
        self.counters.recent.append((time.perf_counter(), 0, spec.num_tokens))

        spans = []  # (request, its rows' offset in the batch, extend, start) of those that want prompt logprobs
        offset = 0
        for item in batch:
            if not item.req.input_logprobs_done:
                spans.append((item.req, offset, item.extend, item.req.kv_len))
            offset += item.extend
        # under overlap_prefill the tree gets the batch's prompts now, so the next batch, admitted before this
        # one's results are read, shares them (the device computes them first, in stream order); otherwise when
        # the results are read, where a request that ends with its prompt gives the tree its tokens in release
        pending = PendingPrefill(hidden, tree_done=self.overlap_prefill)
        try:  # every request's prompt logprobs (a select's choices) in a few batched calls
            pending.logprobs = self._launch_prompt_logprobs(spans, hidden)
        except Exception:  # each request works out its own when resolved: a failure then fails that request alone
            pending.logprobs_failed = True
        t0 = self._phase("logprobs", t0)
        offsets = list(itertools.accumulate((item.extend for item in batch), initial=0))
        # lenders first: a borrower adopts what its lenders have put in the tree (see admission.PrefillAdder)
        for item, offset in sorted(zip(batch, offsets), key=lambda p: p[0].depth):
            r = item.req
            start = r.kv_len
            r.kv_len = start + item.extend  # its new slots are in its row: counted in
            r.new_slots = None
            done = r.kv_len == r.fill_len  # its prompt is all computed
            ends = done and r.remaining_new_tokens() <= 0  # and it generates nothing (a select's choice)
            if pending.tree_done:
                try:
                    self._prefill_tree_work(item, ends=False)
                except Exception as e:
                    self._fail(r, e)
                    continue
            pending.items.append((item, offset, start, done, ends))
            pending.members.add(id(r))
            if done and not ends:
                pending.to_sample.append(r)
                pending.rows.append(offset + item.extend - 1)
        self._phase("cache", t0)
        pending.mixed = any(item.rider for item in batch)
        if self.overlap_prefill and pending.to_sample and all(overlap_ok(r) for r in pending.to_sample):
            t0 = self._now()
            try:
                with self.device_time.span():
                    pending.sampled = sample_on_device(self.runner.logits(hidden, pending.rows), pending.to_sample,
                                                       self.eos_ids, self.generator)
            except Exception:
                pending.sampled = None  # sampled when resolved, request by request where one raises
            self._phase("sample", t0)
        return pending

    def _resolve_prefill(self: Scheduler, pending: PendingPrefill) -> None:
        """Read a launched prefill batch's results: each request's prompt logprobs, the end of those that
        generate nothing (a select's choices), the first token of the others (their callers told once the
        whole batch is read, with follow_up_wait_s). Requests that finished meanwhile (aborted while the batch
        was pending) are skipped."""
        with self._callers_told_after():
            self._read_prefill(pending)

    def _read_prefill(self: Scheduler, pending: PendingPrefill) -> None:
        t0 = self._now()
        hidden = pending.hidden
        batched = None
        if pending.logprobs is not None:
            try:
                batched = pending.logprobs.result()
            except Exception:
                batched = None
        t0 = self._phase("logprobs", t0)
        for item, offset, start, done, ends in pending.items:  # lenders first, as launched
            r = item.req
            if r.finished:
                continue
            try:
                if not r.input_logprobs_done:
                    own = batched if batched is not None else self._prompt_logprobs([(r, offset, item.extend, start)],
                                                                                    hidden)
                    tokens, tops = own[id(r)]
                    r.input_token_logprobs.extend(tokens)
                    r.input_top_logprobs.extend(tops)
                if not pending.tree_done:
                    self._prefill_tree_work(item, ends)
                if done:
                    r.input_logprobs_done = True
                    if ends:
                        self._finish(r, {"type": "length", "length": r.sampling.max_new_tokens})
            except Exception as e:
                self._fail(r, e)
        self._phase("cache", t0)
        if pending.sampled is not None:
            self._advance(pending.to_sample, self._to_host(pending.sampled))  # skips the finished ones
        else:
            live = [(r, row) for r, row in zip(pending.to_sample, pending.rows) if not r.finished]
            if live:
                self._sample_and_advance([r for r, _ in live], hidden, [row for _, row in live])
        if pending.mixed:
            self.counters.mixed_batches += 1
            self.new_token_ratio = max(self.new_token_ratio - 0.002, self.config.min_new_token_ratio)

    def _prefill_tree_work(self: Scheduler, item: PrefillItem, ends: bool) -> None:
        """After a request's chunk is computed: adopt what it borrowed from a lender of its batch, and give the
        tree what it computed (ends: it ends with this chunk and gives the tree its tokens in release instead)."""
        r = item.req
        if r.borrowed:
            self.kv.adopt(r)
        if item.forced:  # generated text and what the grammar forced after it: the tree gets it at the end
            # (sharing it mid-request saves no one anything and cost a tree walk per request and round);
            # jump-forward still rolls back no further than this extend
            r.rollback_floor = r.kv_len
        elif not item.rider and not ends:  # share what is computed (a chunk, or the whole prompt); one that ends
            # now gives the tree its tokens in release (one walk, no lock taken and dropped)
            self.kv.cache_unfinished(r)

    def _encode_media(self: Scheduler, batch: list[PrefillItem]) -> tuple[list[PrefillItem], dict[str, torch.Tensor]]:
        """The encoder features of every image / video part this batch computes, by content hash: from the
        encoder cache, else one encoder pass per distinct item (then cached). A request whose image fails to
        encode fails alone (its new slots, already in its row, are counted in before release)."""
        kept, features = [], {}
        for item in batch:
            r = item.req
            lo, hi = r.kv_len, r.kv_len + item.extend
            try:
                for p in r.mm:
                    key = p.item.hash
                    if p.offset >= hi or p.end <= lo or key in features:
                        continue
                    feats = self.encoder_cache.get(key)
                    if feats is None:
                        t0 = time.perf_counter()
                        feats = self.runner.encode(p.item)  # (num_tokens, hidden)
                        self.counters.encoder_seconds += time.perf_counter() - t0
                        self.counters.encoded_items += 1
                        self.encoder_cache.put(key, feats)
                    features[key] = feats
            except Exception as e:
                r.kv_len += item.extend
                r.new_slots = None
                self._fail(r, e)
                continue
            kept.append(item)
        return kept, features

    def _prompt_logprobs(self: Scheduler, spans: list[tuple[Req, int, int, int]], hidden: Any) -> dict[int, tuple[list, list]]:
        """The prompt logprobs (input_token_logprobs, input_top_logprobs entries) each span's request gets from
        this chunk, by id(req): `_launch_prompt_logprobs` and its result at once."""
        launched = self._launch_prompt_logprobs(spans, hidden)
        return {} if launched is None else launched.result()

    def _launch_prompt_logprobs(self: Scheduler, spans: list[tuple[Req, int, int, int]], hidden: Any
                                ) -> PromptLogprobs | None:
        """Start computing the prompt logprobs each span's request gets from this chunk: tokens
        [logprob_start_len, len) of its prompt, read from hidden rows offset .. offset + extend (positions
        start ..). All spans' rows go through the LM head, log_softmax and top-k together, LOGITS_CHUNK rows a
        call, and cross to the host once (one call a request cost a select's scoring ~1 ms of host time per
        choice, and a device sync each). None when no span wants any."""
        owners: list[tuple[Req, bool, int]] = []  # (req, whether it gets the (None, first token) entry, rows)
        rows: list[int] = []
        targets: list[int] = []
        for r, offset, extend, start in spans:
            prompt = r.origin_input_ids
            s = min(max(r.logprob_start_len, 0), len(prompt) - 1)
            first, last = max(s - 1, start), min(len(prompt) - 1, start + extend)  # positions q -> token q+1
            owners.append((r, s == 0 and start == 0, max(0, last - first)))
            rows.extend(range(first - start + offset, last - start + offset))
            targets.extend(prompt[first + 1: last + 1])
        if not owners:
            return None
        k_max = max(r.top_logprobs_num for r, _, _ in owners)
        # the row and target ids cross to the device once and every chunk's results come back in one copy (a copy
        # per chunk waited for the device each time). log_softmax, not logits less their logsumexp: one fused
        # kernel, where torch's logsumexp makes several passes (on this CPU the phase took 1.5x as long)
        row_ids, target_ids = torch.tensor(rows), torch.tensor(targets)
        device = hidden.device if isinstance(hidden, torch.Tensor) else None
        if device is not None and device.type != "cpu":
            row_ids = row_ids.pin_memory().to(device, non_blocking=True)
            target_ids = target_ids.pin_memory().to(device, non_blocking=True)
        picked, tops_parts = [], []
        vocab = 0
        for c in range(0, len(rows), LOGITS_CHUNK):
            with self.device_time.span():
                lp = self.runner.logits(hidden, row_ids[c: c + LOGITS_CHUNK]).log_softmax(-1)
                vocab = lp.shape[1]
                ids = target_ids[c: c + LOGITS_CHUNK].to(lp.device)
                ids = ids.masked_fill(ids >= vocab, 0)  # an image's pad ids are past the vocabulary
                picked.append(lp.gather(1, ids.unsqueeze(1)).squeeze(1))
                if k_max:
                    tv, ti = lp.topk(k_max, dim=-1)
                    tops_parts.append(torch.cat([tv, ti.to(tv.dtype)], 1))  # ids < 2**24: exact in float32
        return PromptLogprobs(owners, targets, k_max, vocab, torch.cat(picked) if picked else None,
                              torch.cat(tops_parts) if tops_parts else None)


class PendingPrefill:
    """A launched prefill batch whose results are still on the device: per request (in the order the host
    processed it) its rows and what it does next; the prompt logprobs and the first tokens under way."""

    def __init__(self, hidden: Any, tree_done: bool) -> None:
        self.hidden = hidden
        self.logprobs: PromptLogprobs | None = None  # None: no request wanted any, or their launch raised
        self.logprobs_failed = False  # it raised: each request works its own out from the hidden states
        self.tree_done = tree_done  # the tree work (adopt, cache) was done at launch
        # (batch item, its rows' offset, the request's KV length before, its prompt all computed, it ends with it)
        self.items: list[tuple[PrefillItem, int, int, bool, bool]] = []
        self.members: set[int] = set()  # id() of its requests
        self.to_sample: list[Req] = []  # the requests whose first token this batch gives, and their rows
        self.rows: list[int] = []
        self.sampled: DeviceSample | None = None  # the first tokens, sampled on the device at launch
        self.mixed = False

    @property
    def reads_hidden(self) -> bool:
        """Resolving it computes from the hidden states: prompt logprobs whose launch raised, or first tokens
        not sampled at launch (a grammar, penalties, overlap_prefill off, or sampling raised)."""
        return self.logprobs_failed or (bool(self.to_sample) and self.sampled is None)


class PromptLogprobs:
    """A batch's prompt logprobs on their way to the host (pinned, non-blocking on CUDA: `result()` waits for
    this copy only, not for what the device runs after it)."""

    def __init__(self, owners: list[tuple[Req, bool, int]], targets: list[int], k_max: int, vocab: int,
                 picked: torch.Tensor | None, tops: torch.Tensor | None) -> None:
        self.owners, self.targets, self.k_max, self.vocab = owners, targets, k_max, vocab
        self._copy = HostCopy(picked, tops)

    def result(self) -> dict[int, tuple[list, list]]:
        """(input_token_logprobs, input_top_logprobs) entries by id(req)."""
        picked, top_part = self._copy.lists()
        target_lp: list[float] = picked or []
        top_rows: list[list[float]] = top_part or []
        targets, k_max, vocab = self.targets, self.k_max, self.vocab
        out: dict[int, tuple[list, list]] = {}
        at = 0
        for r, head, n in self.owners:
            tokens: list = [(None, r.origin_input_ids[0])] if head else []
            tops: list = [None] if head else []
            k = r.top_logprobs_num
            span = targets[at: at + n]
            # an image's pad ids are past the vocabulary: no logprob
            tokens += [(v if t < vocab else None, t) for v, t in zip(target_lp[at: at + n], span)]
            if k:
                tops += [list(zip(row[:k], (int(i) for i in row[k_max: k_max + k]))) for row in top_rows[at: at + n]]
            else:
                tops += [None] * n
            at += n
            out[id(r)] = (tokens, tops)
        return out
