"""Scheduler: the engine's background thread. Continuous batching over the radix cache.

Each loop: take new requests and aborts, then run either one prefill batch (admitted from the waiting queue in
policy order, limited by free + evictable KV minus the decode growth reserved for running requests, long
prompts chunked) or one decode step for every running request (retracting requests when KV runs out).
Everything that touches the KV pool and the tree runs on this thread.
"""

from __future__ import annotations

import logging
import queue
import re
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from sgnb.engine.config import EngineConfig
from sgnb.engine.events import EventBus
from sgnb.engine.forward_batch import ForwardBatch
from sgnb.engine.model_runner import Runner
from sgnb.engine.radix_cache import RadixCache
from sgnb.engine.request import Req
from sgnb.engine.sampler import sample
from sgnb.engine.schedule_policy import order_waiting
from sgnb.engine.tokenizer import Tokenizer

if TYPE_CHECKING:  # xgrammar loads only once a request is constrained (it imports transformers: ~1.5 s)
    from sgnb.engine.grammar import GrammarBackend

log = logging.getLogger("sgnb.engine")

RESERVE_CLIP = 4096  # never reserve decode room for more than this many tokens of one request
LOGITS_CHUNK = 256  # rows of (rows, vocab) logits materialized at once for input logprobs
MIN_SHARED_PREFIX = 32  # a batch-wide common prefix at least this long is attended once (cascade)


@dataclass
class Counters:
    requests_finished: int = 0
    requests_aborted: int = 0
    requests_failed: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefill_tokens: int = 0  # tokens actually computed by prefill
    generated_tokens: int = 0
    prefill_batches: int = 0
    decode_steps: int = 0
    retractions: int = 0
    forward_seconds: float = 0.0
    recent: deque = field(default_factory=lambda: deque(maxlen=256))  # (time, generated, prefilled)


@dataclass
class _PrefillItem:
    req: Req
    extend: int


class Scheduler:
    def __init__(self, config: EngineConfig, runner: Runner, tree: RadixCache, events: EventBus,
                 eos_ids: tuple[int, ...], tokenizer: Tokenizer, grammar: Callable[[], GrammarBackend]) -> None:
        self.config = config
        self.runner = runner
        self.kv_pool = runner.kv_pool
        self.req_pool = runner.req_pool
        self.tree = tree
        self.events = events
        self.eos_ids = eos_ids
        self.tokenizer = tokenizer
        self.decode = tokenizer.decode
        self.grammar = grammar  # the engine's GrammarBackend, made on first use
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked: Req | None = None
        self.extending: list[Req] = []  # jump-forward appended several tokens: next round extends them
        self.inbox: queue.Queue = queue.Queue()
        self.new_token_ratio = config.init_new_token_ratio
        self.counters = Counters()
        self.generator = torch.Generator(device=runner.device).manual_seed(config.random_seed)
        self._pending_flush: list[Future] = []
        self._stop = False
        self._aborts: set[str] = set()
        self.thread = threading.Thread(target=self._run, name="sgnb-scheduler", daemon=True)
        self.fatal: BaseException | None = None

    # ---- thread-safe entry points ----------------------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def submit(self, req: Req) -> None:
        self.inbox.put(("req", req))

    def abort(self, rid: str) -> None:
        self.inbox.put(("abort", rid))

    def flush(self) -> Future:
        fut: Future = Future()
        self.inbox.put(("flush", fut))
        return fut

    def stop(self) -> None:
        self.inbox.put(("stop", None))
        if self.thread.is_alive():
            self.thread.join(timeout=30)

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running or self.chunked or self.extending)

    # ---- the loop --------------------------------------------------------------------------------------
    def _run(self) -> None:
        with torch.inference_mode():
            self._loop()

    def _loop(self) -> None:
        try:
            while not self._stop:
                self._drain_inbox(block=not self.busy)
                if self._stop:
                    break
                self._apply_aborts()
                if self._pending_flush and not self.busy:
                    self._flush_now()
                if not self.step() and self.busy:
                    time.sleep(0.001)  # nothing could run this round (should not persist; see _admit)
        except BaseException as e:  # a bug in the engine: fail everything loudly rather than hang callers
            log.exception("scheduler crashed")
            self.fatal = e
            for req in self._live():
                try:
                    self._fail(req, e)
                except Exception:  # state may be inconsistent after a crash: still wake the caller
                    req.finish_reason = {"type": "abort", "message": f"engine crashed: {e!r}"}
                    if req.on_update is not None:
                        req.on_update(req)
        finally:
            for fut in self._pending_flush:
                fut.set_result(False)

    def _live(self) -> list[Req]:
        return [*self.waiting, *self.running, *self.extending, *([self.chunked] if self.chunked else [])]

    def step(self) -> bool:
        """One scheduling round. Returns whether a batch ran."""
        batch = self._admit()
        if batch:
            self._run_prefill(batch)
            return True
        if self.running:
            self._run_decode()
            return True
        return False

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, payload = item
            if kind == "req":
                self.waiting.append(payload)
                self.counters.prompt_tokens += len(payload.origin_input_ids)
                # input_ids is the request's own list (no copy): benchmarks compute the optimal hit rate from it
                self.events.emit("request", {"rid": payload.rid, "state": "queued",
                                             "prompt_tokens": len(payload.origin_input_ids),
                                             "input_ids": payload.origin_input_ids})
            elif kind == "abort":
                self._aborts.add(payload)
            elif kind == "flush":
                self._pending_flush.append(payload)
            elif kind == "stop":
                self._stop = True
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return

    # ---- admission -------------------------------------------------------------------------------------
    def _reserve(self, req: Req) -> int:
        return int(min(max(req.remaining_new_tokens(), 0), RESERVE_CLIP) * self.new_token_ratio)

    def _admit(self) -> list[_PrefillItem]:
        """Pick the next prefill batch, lock its prefixes and allocate its KV. Empty when nothing fits."""
        if not self.waiting and self.chunked is None and not self.extending:
            return []
        budget = self.config.max_prefill_tokens
        chunk = self.config.chunked_prefill_size
        reserved = sum(self._reserve(r) for r in self.running)
        batch: list[_PrefillItem] = []

        while self.extending and budget > 0:  # jump-forward continuations: they hold their KV already
            req = self.extending[0]
            ext = len(req.fill_ids) - req.kv_len
            if ext > budget or not self._alloc_extend(req, req.kv_len, ext):
                break
            self.extending.pop(0)
            batch.append(_PrefillItem(req, ext))
            budget -= ext

        if self.chunked is not None:  # a long prompt in progress goes first
            req = self.chunked
            ext = min(len(req.fill_ids) - req.kv_len, budget, chunk)
            if not self._alloc_extend(req, req.kv_len, ext):
                return []  # cannot even continue the chunk: decode frees room over time
            batch.append(_PrefillItem(req, ext))
            budget -= ext
            if req.kv_len + ext == len(req.fill_ids):
                self.chunked = None
                reserved += self._reserve(req)

        deferred_keys: set[tuple] = set()
        compiling = False
        admitted: list[Req] = []
        threshold = self.config.in_batch_prefix_threshold
        for req in order_waiting(self.config.schedule_policy, self.waiting, self.tree):
            if budget <= 0 or len(self.running) + len(batch) >= self.config.max_running_requests:
                break
            if req.grammar_future is not None and req.grammar is None and not self._attach_grammar(req):
                compiling = True
                continue  # still compiling (or failed)
            fill = req.fill_ids
            match = self.tree.match_prefix(fill)
            prefix = min(len(match.indices), len(fill) - 1)  # compute at least one token: its logits
            if not req.input_logprobs_done:
                prefix = min(prefix, max(req.logprob_start_len - 1, 0))
            total = len(fill) - prefix
            if not self.tree.disable and total > threshold:
                # a request sharing this uncached prefix is in the batch: wait one round and hit the cache
                key = (prefix, tuple(fill[prefix: prefix + threshold]))
                if key in deferred_keys:
                    continue
                deferred_keys.add(key)
            ext = min(total, budget, chunk)
            if ext < total and self.chunked is not None:
                continue  # one chunked request at a time
            need = ext + (self._reserve(req) if ext == total else 0)
            if need > self.kv_pool.available + self.tree.evictable_size - reserved:
                break
            row = self.req_pool.alloc()
            if row is None:
                break
            req.req_pool_idx = row
            self.tree.inc_lock_ref(match.last_node)
            req.last_node = match.last_node
            if prefix:
                self.req_pool.write(row, 0, match.indices[:prefix])
            req.kv_len = req.cached_len = prefix
            if not self._alloc_extend(req, prefix, ext):
                self._release(req, cache=False)
                break
            if prefix:
                self.tree.record_hit(match.last_node, req.rid)
            if req.cached_tokens < 0:
                req.cached_tokens = prefix
                self.counters.cached_tokens += prefix
            batch.append(_PrefillItem(req, ext))
            admitted.append(req)
            budget -= ext
            if ext < total:
                self.chunked = req
            else:
                reserved += self._reserve(req)
        if admitted:
            ids = {id(r) for r in admitted}
            self.waiting = [r for r in self.waiting if id(r) not in ids]
        if not batch and self.waiting and not self.running and self.chunked is None and not compiling:
            # nothing runs and nothing will free memory: the head request can never fit
            req = self.waiting.pop(0)
            self._fail(req, MemoryError(
                f"request needs more KV cache than the pool holds ({self.kv_pool.size} tokens)"))
        return batch

    def _attach_grammar(self, req: Req) -> bool:
        """Give an admitted request its matcher once its grammar compiled; force the grammar's fixed opening
        (e.g. '{"name": "') into the output before the first prefill."""
        fut = req.grammar_future
        if not fut.done():
            return False
        try:
            req.grammar = self.grammar().matcher(fut.result())
        except Exception as e:
            self._fail(req, e)
            return False
        if not self.config.disable_jump_forward and not req.output_ids:
            from sgnb.engine.grammar import jump_forward

            jf = jump_forward(req.grammar, [], self.tokenizer, max_growth=req.remaining_new_tokens() - 1)
            if jf is not None:
                self._append_forced(req, jf.forced_ids)
        return True

    def _append_forced(self, req: Req, ids: list[int]) -> None:
        req.output_ids.extend(ids)
        req.forced.extend([True] * len(ids))
        if req.return_logprob:  # not sampled: no distribution was consulted
            req.output_token_logprobs.extend((None, t) for t in ids)
            req.output_top_logprobs.extend([None] * len(ids))

    def _alloc_extend(self, req: Req, start: int, n: int) -> bool:
        slots = self._alloc(n)
        if slots is None:
            return False
        assert req.req_pool_idx is not None
        self.req_pool.write(req.req_pool_idx, start, slots)
        req._pending_slots = slots  # type: ignore[attr-defined]
        return True

    def _alloc(self, n: int) -> torch.Tensor | None:
        slots = self.kv_pool.alloc(n)
        if slots is None:
            self.tree.evict(n - self.kv_pool.available)
            slots = self.kv_pool.alloc(n)
        return slots

    # ---- prefill ---------------------------------------------------------------------------------------
    def _run_prefill(self, batch: list[_PrefillItem]) -> None:
        reqs = [item.req for item in batch]
        ids, positions, locs = [], [], []
        for item in batch:
            r = item.req
            ids.extend(r.fill_ids[r.kv_len: r.kv_len + item.extend])
            positions.append(torch.arange(r.kv_len, r.kv_len + item.extend))
            locs.append(r._pending_slots)  # type: ignore[attr-defined]
        dev = self.runner.device
        fb = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.cat(positions).to(dev),
            out_cache_loc=torch.cat(locs),
            req_pool_indices=[r.req_pool_idx for r in reqs],  # type: ignore[misc]
            prefix_lens=[r.kv_len for r in reqs],
            extend_lens=[item.extend for item in batch],
            req_to_token=self.req_pool.req_to_token,
        )
        hidden = self._forward(fb, reqs)
        if hidden is None:
            return
        self.counters.prefill_batches += 1
        self.counters.prefill_tokens += fb.num_tokens
        self.counters.recent.append((time.perf_counter(), 0, fb.num_tokens))

        to_sample: list[Req] = []
        rows: list[int] = []
        offset = 0
        for item in batch:
            r = item.req
            start = r.kv_len
            try:
                if not r.input_logprobs_done:
                    self._input_logprobs(r, hidden, offset, item.extend, start)
                r.kv_len = start + item.extend
                if r.kv_len < len(r.fill_ids):  # a chunk of a long prompt: share it, continue next round
                    self._cache_unfinished(r)
                else:
                    r.input_logprobs_done = True
                    self._cache_unfinished(r)
                    if r.remaining_new_tokens() <= 0:
                        self._finish(r, {"type": "length", "length": r.sampling.max_new_tokens})
                    else:
                        to_sample.append(r)
                        rows.append(offset + item.extend - 1)
            except Exception as e:
                self._fail(r, e)
            offset += item.extend
        if to_sample:
            self._sample_and_advance(to_sample, hidden, rows)
            extending = {id(r) for r in self.extending}
            self.running.extend(r for r in to_sample if not r.finished and id(r) not in extending)

    def _forward(self, fb: ForwardBatch, reqs: list[Req]) -> Any:
        """Run the model (cascade attention over the batch's shared prefix). A failure fails these requests
        only: their new slots are already in their rows, so count them in before releasing."""
        fb.shared_len = self._shared_prefix_len(fb.req_pool_indices, min(fb.prefix_lens))
        t0 = time.perf_counter()
        try:
            hidden = self.runner.forward(fb)
        except Exception as e:
            for r, ext in zip(list(reqs), fb.extend_lens):
                r.kv_len += ext
                self._fail(r, e)
            return None
        self.counters.forward_seconds += time.perf_counter() - t0
        return hidden

    def _input_logprobs(self, req: Req, hidden: Any, offset: int, extend: int, start: int) -> None:
        """Logprobs of prompt tokens [logprob_start_len, len) from this chunk's hidden rows
        offset .. offset + extend (positions start ..)."""
        prompt = req.origin_input_ids
        s = min(max(req.logprob_start_len, 0), len(prompt) - 1)
        if s == 0 and start == 0:
            req.input_token_logprobs.append((None, prompt[0]))
            req.input_top_logprobs.append(None)
        first, last = max(s - 1, start), min(len(prompt) - 1, start + extend)  # positions q -> token q+1
        k = req.top_logprobs_num
        for c in range(first, last, LOGITS_CHUNK):
            q = torch.arange(c, min(c + LOGITS_CHUNK, last))
            lp = self.runner.logits(hidden, q - start + offset).log_softmax(-1)  # (n, V)
            targets = torch.tensor([prompt[i + 1] for i in q.tolist()], device=lp.device)
            vals = lp.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
            req.input_token_logprobs.extend(zip(vals, targets.tolist()))
            if k:
                tv, ti = lp.topk(k, dim=-1)
                req.input_top_logprobs.extend(list(zip(a, b)) for a, b in zip(tv.tolist(), ti.tolist()))
            else:
                req.input_top_logprobs.extend([None] * len(vals))

    # ---- decode ----------------------------------------------------------------------------------------
    def _run_decode(self) -> None:
        self._make_room_for_decode()
        reqs = self.running
        if not reqs:
            return
        slots = self._alloc(len(reqs))
        assert slots is not None, "decode room was ensured"
        rows = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64)
        kv_lens = torch.tensor([r.kv_len for r in reqs], dtype=torch.int64)
        self.req_pool.write_points(rows.to(slots.device), kv_lens.to(slots.device), slots)
        dev = self.runner.device
        fb = ForwardBatch(
            input_ids=torch.tensor([r.output_ids[-1] for r in reqs], dtype=torch.int64, device=dev),
            positions=kv_lens.to(dev),
            out_cache_loc=slots,
            req_pool_indices=rows.tolist(),
            prefix_lens=kv_lens.tolist(),
            extend_lens=[1] * len(reqs),
            req_to_token=self.req_pool.req_to_token,
        )
        hidden = self._forward(fb, reqs)
        if hidden is None:
            return
        self.counters.decode_steps += 1
        for r in reqs:
            r.kv_len += 1
        self._sample_and_advance(list(reqs), hidden, None)
        self.new_token_ratio = max(self.new_token_ratio - 0.002, self.config.min_new_token_ratio)

    def _shared_prefix_len(self, rows: list[int], limit: int) -> int:
        """How many leading KV slots all these requests have in common (0 when too few to matter)."""
        if len(rows) < 2 or limit < MIN_SHARED_PREFIX:
            return 0
        table = self.req_pool.req_to_token[torch.tensor(rows, device=self.runner.device), :limit]  # (B, limit)
        differs = (table != table[:1]).any(0).nonzero()
        n = int(differs[0]) if len(differs) else limit
        return n if n >= MIN_SHARED_PREFIX else 0

    def _make_room_for_decode(self) -> None:
        need = len(self.running)
        short = need - self.kv_pool.available
        if short > 0:
            self.tree.evict(short)
        # retract the requests with the most work left until one slot per request fits
        while self.running and len(self.running) > self.kv_pool.available:
            victim = max(self.running, key=lambda r: (r.remaining_new_tokens(), -len(r.output_ids)))
            self.running.remove(victim)
            self._retract(victim)
            self.tree.evict(len(self.running) - self.kv_pool.available)

    def _retract(self, req: Req) -> None:
        self._release(req, cache=True)
        req.num_retractions += 1
        self.counters.retractions += 1
        self.waiting.insert(0, req)
        self.new_token_ratio = min(1.0, self.new_token_ratio + 0.1)
        self.events.emit("request", {"rid": req.rid, "state": "retracted"})

    # ---- sampling and finishing ------------------------------------------------------------------------
    def _sample_and_advance(self, reqs: list[Req], hidden: Any, rows: list[int] | None) -> None:
        """Sample the next token of each request from `rows` of the forward's hidden states (all when None)."""
        try:
            out = sample(self.runner.logits(hidden, rows), reqs, self.eos_ids, self.generator,
                         self._grammar_mask(reqs))
        except Exception as e:  # e.g. a penalty on a bad token id: fails this batch, not the engine
            for r in reqs:
                self._fail(r, e)
            return
        now = time.perf_counter()
        self.counters.generated_tokens += len(reqs)
        self.counters.recent.append((now, len(reqs), 0))
        for i, r in enumerate(reqs):
            try:
                token = out.token_ids[i]
                r.output_ids.append(token)
                r.forced.append(False)
                r.decode_steps += 1
                if r.first_token_time is None:
                    r.first_token_time = now
                if r.return_logprob:
                    r.output_token_logprobs.append((out.logprobs[i], token))  # type: ignore[index]
                    r.output_top_logprobs.append(out.top_logprobs[i] if out.top_logprobs else None)
                if r.grammar is not None and not r.grammar.accept_token(token):
                    raise RuntimeError(f"the grammar rejected token {token} that its own mask allowed")
                self._check_finish(r, token)
                if not r.finished and r.grammar is not None and not self.config.disable_jump_forward:
                    self._jump_forward(r)
                if not r.finished and r.on_update is not None:
                    r.on_update(r)
            except Exception as e:
                self._fail(r, e)
        extending = {id(r) for r in self.extending}
        self.running = [r for r in self.running if not r.finished and id(r) not in extending]

    def _grammar_mask(self, reqs: list[Req]) -> Callable[[torch.Tensor], None] | None:
        rows = [i for i, r in enumerate(reqs) if r.grammar is not None]
        if not rows:
            return None
        from sgnb.engine.grammar import apply_bitmask

        backend = self.grammar()
        bitmask = backend.allocate_bitmask(len(reqs))
        backend.fill_bitmasks([reqs[i].grammar for i in rows], bitmask, rows)
        return lambda logits: apply_bitmask(logits, bitmask, rows)

    def _jump_forward(self, req: Req) -> None:
        """The grammar admits one continuation: append its canonical tokens now (re-tokenizing the last few
        generated tokens with it), to be computed by one extend next round instead of one decode each."""
        fill_len = len(req.fill_ids)
        growth = min(req.remaining_new_tokens(), self.runner.context_length - 1 - fill_len) - 1
        if growth <= 0:
            return
        from sgnb.engine.grammar import jump_forward

        jf = jump_forward(req.grammar, req.output_ids, self.tokenizer,
                          max_rollback=min(4, fill_len - req.cached_len), max_growth=growth)
        if jf is None:
            return
        k = jf.rollback_tokens
        if k:  # drop the last k tokens; the newest had no KV yet, the other k - 1 did (request-owned)
            new_kv = fill_len - k
            self.kv_pool.free(self.req_pool.req_to_token[req.req_pool_idx, new_kv: req.kv_len].clone())
            req.kv_len = new_kv
            del req.output_ids[-k:], req.forced[-k:]
            if req.return_logprob:
                del req.output_token_logprobs[-k:], req.output_top_logprobs[-k:]
        self._append_forced(req, jf.forced_ids)
        req.text = self.decode(req.output_ids, req.sampling.skip_special_tokens)
        if self._check_stop_strings(req):
            return
        if req.grammar.stop_is_forced():  # the forced text completed the grammar: no forward needed
            self._finish(req, {"type": "stop", "matched": self.eos_ids[0]})
            return
        self.extending.append(req)

    def _check_finish(self, req: Req, token: int) -> None:
        sp = req.sampling
        n_out = len(req.output_ids)
        may_stop = n_out >= sp.min_new_tokens
        if req.grammar is not None and (req.grammar.is_terminated() or req.grammar.stop_is_forced()):
            # the constrained text is complete: end here (a forced stop needs no extra forward)
            ended_on_stop = req.grammar.is_terminated()
            req.text = self.decode(req.output_ids[:-1] if ended_on_stop else req.output_ids, sp.skip_special_tokens)
            self._finish(req, {"type": "stop", "matched": token if ended_on_stop else self.eos_ids[0]})
            return
        if may_stop and ((not sp.ignore_eos and token in self.eos_ids) or token in sp.stop_token_ids):
            req.text = self.decode(req.output_ids if sp.no_stop_trim else req.output_ids[:-1],
                                   sp.skip_special_tokens)
            self._finish(req, {"type": "stop", "matched": token})
            return
        req.text = self.decode(req.output_ids, sp.skip_special_tokens)
        if self._check_stop_strings(req):
            return
        if n_out >= sp.max_new_tokens:
            self._finish(req, {"type": "length", "length": sp.max_new_tokens})
        elif req.kv_len + 1 >= self.runner.context_length:
            self._finish(req, {"type": "length", "length": n_out, "message": "context length reached"})

    def _check_stop_strings(self, req: Req) -> bool:
        """Finish the request if its text holds a stop string or stop regex match (trimmed off). req.text must
        be current."""
        sp = req.sampling
        if len(req.output_ids) < sp.min_new_tokens:
            return False
        if sp.stop:
            hits = [(req.text.find(s), s) for s in sp.stop]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                pos, s = min(hits)
                if not sp.no_stop_trim:
                    req.text = req.text[:pos]
                self._finish(req, {"type": "stop", "matched": s})
                return True
        for pattern in sp.stop_regex:
            m = re.search(pattern, req.text)
            if m:
                if not sp.no_stop_trim:
                    req.text = req.text[: m.start()]
                self._finish(req, {"type": "stop", "matched": m.group(0)})
                return True
        return False

    def _finish(self, req: Req, reason: dict[str, Any], cache: bool = True) -> None:
        req.finish_reason = reason
        req.finished_time = time.perf_counter()
        self._release(req, cache=cache)
        c = self.counters
        if reason["type"] == "abort":
            c.requests_aborted += 1
        else:
            c.requests_finished += 1
        self.events.emit("request", {"rid": req.rid, "state": "finished", "reason": reason["type"],
                                     "completion_tokens": len(req.output_ids)})
        if req.on_update is not None:
            req.on_update(req)

    def _fail(self, req: Req, exc: BaseException) -> None:
        log.warning("request %s failed: %r", req.rid, exc)
        req.error = exc
        self.counters.requests_failed += 1
        self._finish(req, {"type": "abort", "message": f"{type(exc).__name__}: {exc}"}, cache=False)
        for queue_ in (self.running, self.waiting, self.extending):
            if req in queue_:
                queue_.remove(req)

    # ---- KV ownership ----------------------------------------------------------------------------------
    def _cache_unfinished(self, req: Req) -> None:
        """Hand the computed prefix of a live request to the tree so others can share it; keep it locked."""
        if self.tree.disable:
            return
        row = req.req_pool_idx
        slots = self.req_pool.req_to_token[row, : req.kv_len]
        key = req.fill_ids[: req.kv_len]
        present = self.tree.insert(key, slots)
        if present > req.cached_len:  # someone else cached these first: drop our copies
            self.kv_pool.free(slots[req.cached_len: present].clone())
        match = self.tree.match_prefix(key)
        assert len(match.indices) == req.kv_len
        self.req_pool.write(row, 0, match.indices)
        self.tree.inc_lock_ref(match.last_node)
        if req.last_node is not None:
            self.tree.dec_lock_ref(req.last_node)
        req.last_node = match.last_node
        req.cached_len = req.kv_len

    def _release(self, req: Req, cache: bool) -> None:
        """Give back the request's row, its own KV slots (to the tree when cache) and its lock."""
        row = req.req_pool_idx
        if row is None:
            return
        slots = self.req_pool.req_to_token[row, : req.kv_len].clone()
        own_from = req.cached_len
        if cache and not self.tree.disable and req.kv_len > 0:
            own_until = self.tree.insert(req.fill_ids[: req.kv_len], slots)
            self.kv_pool.free(slots[own_from: max(own_until, own_from)])
        else:
            self.kv_pool.free(slots[own_from:])
        if req.last_node is not None:
            self.tree.dec_lock_ref(req.last_node)
        self.req_pool.free(row)
        req.req_pool_idx, req.last_node, req.kv_len, req.cached_len = None, None, 0, 0
        if self.chunked is req:
            self.chunked = None

    def _apply_aborts(self) -> None:
        if not self._aborts:
            return
        for req in self._live():
            if req.rid in self._aborts and not req.finished:
                # release first, then leave the queues: an observer never sees idle with locks still held
                self._finish(req, {"type": "abort", "message": "aborted"})
                if req in self.waiting:
                    self.waiting.remove(req)
                if req in self.running:
                    self.running.remove(req)
                if req in self.extending:
                    self.extending.remove(req)
        self._aborts.clear()

    def _flush_now(self) -> None:
        self.tree.evict(self.tree.total_size)
        assert self.tree.total_size == 0 and self.kv_pool.available == self.kv_pool.size
        self.tree.reset()
        self.kv_pool.clear()
        for fut in self._pending_flush:
            fut.set_result(True)
        self._pending_flush = []
