"""Scheduler: the engine's background thread. Continuous batching over the radix cache.

Each loop: take new requests and aborts, then run either one prefill batch (admission.py: continuations of
admitted requests, then waiting requests in policy order) or one decode step for every running request
(retracting requests when KV runs out). Requests are either `waiting` (the admission queue) or `active`
(admitted: their `status` says whether they decode, continue a chunked prompt or extend forced tokens).
KV slots change owners only through kv_manager.py. Everything that touches the KV pool and the tree runs on
this thread.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from sgnb.engine.admission import Added, PrefillAdder, PrefillItem, reserve
from sgnb.engine.config import EngineConfig
from sgnb.engine.events import EventBus
from sgnb.engine.forward_batch import BatchSpec, to_device
from sgnb.engine.kv_manager import KVManager
from sgnb.engine.media import PLACEHOLDER_ID, EncoderCache, is_pad
from sgnb.engine.model_runner import Runner
from sgnb.engine.radix_cache import RadixCache
from sgnb.engine.request import Req, ReqStatus
from sgnb.engine.sampler import DeviceSample, SampleOutput, sample, sample_on_device
from sgnb.engine.schedule_policy import order_waiting
from sgnb.engine.stops import first_stop, has_stop, regex_window_start
from sgnb.engine.tokenizer import Tokenizer

if TYPE_CHECKING:  # xgrammar loads only once a request is constrained (it imports transformers: ~1.5 s)
    from sgnb.engine.grammar import GrammarBackend

log = logging.getLogger("sgnb.engine")

DETOK_CONTEXT = 6  # tokens of already-emitted text that incremental detokenization decodes again for context
LOGITS_CHUNK = 256  # rows of (rows, vocab) logits materialized at once for input logprobs
MIN_SHARED_PREFIX = 32  # a batch-wide common prefix at least this long is attended once (cascade)


SLOWEST_KEPT = 8


def describe_forward(spec: BatchSpec) -> str:
    """One line for a forward in the stats: its kind, tokens, requests, prefix and graph."""
    kind = spec.mode.name.lower()
    prefix = max(spec.prefix_lens, default=0)
    return (f"{kind} tokens={spec.num_tokens} requests={spec.batch_size} max_prefix={prefix} "
            f"shared={spec.shared_len} {'graph' if spec.graphed else 'eager'}")


# admit: picking the prefill batch; build: its inputs (ids, slots, groups); forward: the model's launch (on a GPU
# the kernels run asynchronously after it); sample: LM head, grammar masks, sampling, the tokens to the host
# (on a GPU this waits for the forward); advance: appending tokens, finish checks, detokenizing, callbacks;
# jump_forward: the part of advance spent on jump-forward; cache: prefill bookkeeping (prompt logprobs, the
# tree's share of a computed chunk); idle: waiting for requests (the inbox) or for room
PHASES = ("admit", "build", "forward", "sample", "advance", "jump_forward", "cache", "idle")


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
    decode_seconds: float = 0.0  # wall time of decode rounds (forward, sampling, bookkeeping)
    cascade_batches: int = 0  # forwards that read a batch-wide shared prefix once
    graphed_forwards: int = 0  # forwards that replayed a CUDA graph (decode or extend)
    eager_forwards: int = 0  # the others (on a GPU each costs ~20 ms of host launches)
    eager_seconds: float = 0.0
    # the slowest forwards as (seconds, description), longest first: a kernel compiling inside a workload, or a
    # shape that falls off the CUDA graphs, shows here
    slowest: list = field(default_factory=list)
    overlapped_steps: int = 0  # decode steps launched before the previous step's tokens reached the host
    mixed_batches: int = 0  # prefill forwards that running requests' decode steps rode along with
    encoded_items: int = 0  # images / videos run through the encoder (cache misses)
    encoder_seconds: float = 0.0
    recent: deque = field(default_factory=lambda: deque(maxlen=256))  # (time, generated, prefilled)
    # the scheduler thread's wall time by phase (see Scheduler._phase): where a round's host time goes
    phases: dict = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))


class Scheduler:
    def __init__(self, config: EngineConfig, runner: Runner, tree: RadixCache, events: EventBus,
                 eos_ids: tuple[int, ...], tokenizer: Tokenizer, grammar: Callable[[], GrammarBackend]) -> None:
        self.config = config
        self.runner = runner
        self.kv_pool = runner.kv_pool
        self.req_pool = runner.req_pool
        self.tree = tree
        self.kv = KVManager(runner.kv_pool, runner.req_pool, tree)
        default_mm = (1 << 30) if runner.device.type == "cuda" else (256 << 20)
        self.encoder_cache = EncoderCache(config.encoder_cache_bytes or default_mm)
        self.events = events
        self.eos_ids = eos_ids
        self.tokenizer = tokenizer
        self.decode = tokenizer.decode
        self.grammar = grammar  # the engine's GrammarBackend, made on first use
        self.waiting: list[Req] = []  # the admission queue (status WAITING), in arrival order
        self.active: list[Req] = []  # admitted requests (RUNNING, CHUNKED, EXTENDING), in admission order
        self.inbox: queue.Queue = queue.Queue()
        self.new_token_ratio = config.init_new_token_ratio
        self.counters = Counters()
        self.generator = torch.Generator(device=runner.device).manual_seed(config.random_seed)
        self._pending_flush: list[Future] = []
        self._stop = False
        self._aborts: set[str] = set()
        self.thread = threading.Thread(target=self._run, name="sgnb-scheduler", daemon=True)
        self.fatal: BaseException | None = None
        self._rids: set[str] = set()  # rids of requests submitted and not finished (submit checks them)
        # overlap scheduling (see _launch): on CUDA in this process unless disabled; forced on for tests
        overlap = config.disable_overlap_schedule
        self.overlap = (runner.device.type == "cuda" and getattr(runner, "supports_overlap", False)
                        if overlap is None else not overlap)
        self._pending: _Pending | None = None  # a decode step whose tokens are still on the device
        self._rid_lock = threading.Lock()

    # ---- thread-safe entry points ----------------------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def submit(self, *reqs: Req) -> None:
        """Queue requests (any thread). Their rids must be free: a rid names one request in flight (abort by
        rid must not hit another client's), so one already in use raises ValueError and nothing is queued."""
        with self._rid_lock:
            taken = [r.rid for r in reqs if r.rid in self._rids]
            seen: set[str] = set()
            taken += [r.rid for r in reqs if r.rid in seen or seen.add(r.rid)]  # type: ignore[func-returns-value]
            if taken:
                raise ValueError(f"rid {taken[0]!r} is already in use by a request in flight: give each request "
                                 "its own rid (or none)")
            self._rids.update(seen)
        for req in reqs:
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

    def reset_counters(self) -> None:
        """Start the statistics afresh (after the engine's warm-up; call only while no request is in flight)."""
        assert not self.busy
        self.counters = Counters()
        self.new_token_ratio = self.config.init_new_token_ratio

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.active)

    def count(self, status: ReqStatus) -> int:
        return sum(r.status is status for r in self.active)

    def _with(self, status: ReqStatus) -> list[Req]:
        return [r for r in self.active if r.status is status]

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
                    self._resolve_pending()  # a step of aborted requests may still be pending
                    self._flush_now()
                if not self.step() and self.busy:
                    t0 = time.perf_counter()
                    time.sleep(0.001)  # nothing could run this round (e.g. a grammar still compiling)
                    self._phase("idle", t0)
        except BaseException as e:  # a bug in the engine: fail everything loudly rather than hang callers
            log.exception("scheduler crashed")
            self.fatal = e
            for req in self._live():
                try:
                    self._fail(req, e)
                except Exception:  # state may be inconsistent after a crash: still wake the caller
                    req.finish_reason = {"type": "abort", "message": f"engine crashed: {e!r}"}
                    try:
                        if req.on_update is not None:
                            req.on_update(req)
                    except Exception:
                        pass  # that caller is gone too
        finally:
            for fut in self._pending_flush:
                fut.set_result(False)

    def _live(self) -> list[Req]:
        return [*self.waiting, *self.active]

    def step(self) -> bool:
        """One scheduling round. Returns whether a batch ran."""
        if self._pending is not None:
            nxt = self._overlap_batch()
            if nxt is not None:
                t0 = time.perf_counter()
                self._decode_overlapped(nxt)
                self.counters.decode_seconds += time.perf_counter() - t0
                return True
            self._resolve_pending()
        t0 = time.perf_counter()
        batch = self._admit()
        self._phase("admit", t0)
        if batch:
            self._run_prefill(batch)
            return True
        if any(r.status is ReqStatus.RUNNING for r in self.active):
            self._run_decode()
            return True
        return False

    def _phase(self, name: str, t0: float) -> float:
        """Count the time since t0 to a phase of Counters.phases; returns now."""
        now = time.perf_counter()
        self.counters.phases[name] += now - t0
        return now

    def _drain_inbox(self, block: bool) -> None:
        t0 = time.perf_counter()
        try:
            item = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
        except queue.Empty:
            if block:
                self._phase("idle", t0)
            return
        if block:
            self._phase("idle", t0)
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
    def _admit(self) -> list[PrefillItem]:
        """Pick the next prefill batch, lock its prefixes and allocate its KV. Empty when nothing fits."""
        if not self.waiting and not any(r.status is not ReqStatus.RUNNING for r in self.active):
            return []
        running = self._with(ReqStatus.RUNNING)
        adder = PrefillAdder(self.config, self.kv, self.tree, sum(reserve(r, self.new_token_ratio) for r in running),
                             self.new_token_ratio)
        for req in self._with(ReqStatus.EXTENDING):  # jump-forward continuations: they hold their KV already
            if not adder.add_continuation(req, chunk=False):
                break
        chunked = self._with(ReqStatus.CHUNKED)  # a long prompt in progress goes before new requests
        stuck = bool(chunked) and not adder.add_continuation(chunked[0], chunk=True)
        compiling, admitted = False, []
        for req in [] if stuck else order_waiting(self.config.schedule_policy, self.waiting, self.tree):
            if adder.full or len(self.active) + len(admitted) >= self.config.max_running_requests:
                break
            if req.grammar_future is not None and req.grammar is None and not self._attach_grammar(req):
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
        if adder.items and running and not self.config.disable_mixed_batches:
            adder.add_riders(running)
        if not adder.items and self.waiting and not self.active and not compiling:
            # nothing runs and nothing will free memory: the head request can never fit
            req = self.waiting.pop(0)
            self._fail(req, MemoryError(
                f"request needs more KV cache than the pool holds ({self.kv_pool.size} tokens)"))
        return adder.items

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

    # ---- prefill ---------------------------------------------------------------------------------------
    def _run_prefill(self, batch: list[PrefillItem]) -> None:
        t0 = time.perf_counter()
        batch, features = self._encode_media(batch)
        if not batch:
            return
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
        spec = BatchSpec(
            input_ids=ids,
            out_cache_loc=torch.cat([r.new_slots for r in reqs]),  # type: ignore[misc]
            req_pool_indices=[r.req_pool_idx for r in reqs],  # type: ignore[misc]
            prefix_lens=[r.kv_len for r in reqs],
            extend_lens=[item.extend for item in batch],
            groups=groups,
            mm_rows=mm_rows or None,
            mm_embeds=torch.cat(mm_parts) if mm_parts else None,
        )
        self._phase("build", t0)
        hidden = self._forward(spec, reqs)
        if hidden is None:
            return
        t0 = time.perf_counter()
        self.counters.prefill_batches += 1
        self.counters.prefill_tokens += spec.num_tokens
        self.counters.recent.append((time.perf_counter(), 0, spec.num_tokens))

        spans = []  # (request, its rows' offset in the batch, extend, start) of those that want prompt logprobs
        offset = 0
        for item in batch:
            if not item.req.input_logprobs_done:
                spans.append((item.req, offset, item.extend, item.req.kv_len))
            offset += item.extend
        try:  # every request's prompt logprobs (a select's choices) in a few batched calls
            batched = self._prompt_logprobs(spans, hidden)
        except Exception:
            batched = None  # each request works out its own below: a failure then fails that request alone
        to_sample: list[Req] = []
        rows: list[int] = []
        offsets = list(itertools.accumulate((item.extend for item in batch), initial=0))
        # lenders first: a borrower adopts what its lenders have put in the tree (see admission.PrefillAdder)
        for item, offset in sorted(zip(batch, offsets), key=lambda p: p[0].depth):
            r = item.req
            start = r.kv_len
            try:
                if not r.input_logprobs_done:
                    own = batched if batched is not None else self._prompt_logprobs([(r, offset, item.extend, start)],
                                                                                    hidden)
                    tokens, tops = own[id(r)]
                    r.input_token_logprobs.extend(tokens)
                    r.input_top_logprobs.extend(tops)
                r.kv_len = start + item.extend
                r.new_slots = None
                if r.borrowed:
                    self.kv.adopt(r)
                if item.forced:  # generated text and what the grammar forced after it: the tree gets it at the
                    # end (sharing it mid-request saves no one anything and cost a tree walk per request and
                    # round); jump-forward still rolls back no further than this extend
                    r.rollback_floor = r.kv_len
                elif not item.rider:  # share what is computed (a chunk, or the whole prompt)
                    self.kv.cache_unfinished(r)
                if r.kv_len == r.fill_len:
                    r.input_logprobs_done = True
                    if r.remaining_new_tokens() <= 0:
                        self._finish(r, {"type": "length", "length": r.sampling.max_new_tokens})
                    else:
                        to_sample.append(r)
                        rows.append(offset + item.extend - 1)
            except Exception as e:
                if r.new_slots is not None:  # its new slots are in its row: count them in before release
                    r.kv_len = start + item.extend
                    r.new_slots = None
                self._fail(r, e)
        self._phase("cache", t0)
        if to_sample:
            self._sample_and_advance(to_sample, hidden, rows)
        if any(item.rider for item in batch):
            self.counters.mixed_batches += 1
            self.new_token_ratio = max(self.new_token_ratio - 0.002, self.config.min_new_token_ratio)

    def _groups(self, reqs: list[Req]) -> tuple[list[int], list[tuple[int, int, int]] | None]:
        """An order of the batch that puts requests sharing a cached prefix together, and those groups (see
        KVManager.group_by_prefix); the identity and None when nothing can be shared."""
        if len(reqs) < 2 or self.tree.disable or self.config.disable_cascade:
            return list(range(len(reqs))), None
        order, groups = self.kv.group_by_prefix(reqs, MIN_SHARED_PREFIX)
        if all(shared == 0 for _, _, shared in groups):
            return list(range(len(reqs))), None
        return order, groups

    def _encode_media(self, batch: list[PrefillItem]) -> tuple[list[PrefillItem], dict[str, torch.Tensor]]:
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

    def _forward(self, spec: BatchSpec, reqs: list[Req]) -> Any:
        """Run the model (cascade attention over the batch's shared prefix). A failure fails these requests
        only: their new slots are already in their rows, so count them in before releasing."""
        # a graph replay reads every request's whole key range: the shared prefix is worked out (a walk of
        # every request's tree path, each step) only for forwards that run eagerly
        cascade = not self.config.disable_cascade and not self.runner.replays_graph(spec)
        shared = self.kv.shared_prefix_len(reqs) if cascade else 0
        spec.shared_len = shared if shared >= MIN_SHARED_PREFIX else 0
        t0 = time.perf_counter()
        try:
            hidden = self.runner.forward(spec)
            self.counters.cascade_batches += not spec.graphed and (
                spec.shared_len > 0 or any(g[2] for g in spec.groups or ()))
            self.counters.graphed_forwards += spec.graphed
        except Exception as e:
            for r, ext in zip(list(reqs), spec.extend_lens):
                r.kv_len += ext
                r.new_slots = None
                self._fail(r, e)
            return None
        dt = time.perf_counter() - t0
        c = self.counters
        c.forward_seconds += dt
        c.phases["forward"] += dt
        if not spec.graphed:
            c.eager_forwards += 1
            c.eager_seconds += dt
        if len(c.slowest) < SLOWEST_KEPT or dt > c.slowest[-1][0]:
            # a new list, not sorted in place: get_stats() reads it from other threads (an in-place sort shows
            # them an empty list meanwhile)
            c.slowest = sorted([*c.slowest, (dt, describe_forward(spec))], key=lambda x: -x[0])[:SLOWEST_KEPT]
        return hidden

    def _prompt_logprobs(self, spans: list[tuple[Req, int, int, int]], hidden: Any) -> dict[int, tuple[list, list]]:
        """The prompt logprobs (input_token_logprobs, input_top_logprobs entries) each span's request gets from
        this chunk, by id(req): tokens [logprob_start_len, len) of its prompt, read from hidden rows offset ..
        offset + extend (positions start ..). All spans' rows go through the LM head, log_softmax and top-k
        together, LOGITS_CHUNK rows a call, and cross to the host once a chunk (one call a request cost a
        select's scoring ~1 ms of host time per choice, and a device sync each)."""
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
            return {}
        k_max = max(r.top_logprobs_num for r, _, _ in owners)
        table: list[list[float]] = []  # per row: the target's logprob, then k_max top values, then their ids
        vocab = 0
        for c in range(0, len(rows), LOGITS_CHUNK):
            lp = self.runner.logits(hidden, torch.tensor(rows[c: c + LOGITS_CHUNK])).log_softmax(-1)
            vocab = lp.shape[1]
            ids = torch.tensor([t if t < vocab else 0 for t in targets[c: c + LOGITS_CHUNK]], device=lp.device)
            parts = [lp.gather(1, ids.unsqueeze(1))]
            if k_max:
                tv, ti = lp.topk(k_max, dim=-1)
                parts += [tv, ti.to(lp.dtype)]  # ids < 2**24: exact in float32
            table.extend(torch.cat(parts, 1).tolist())
        out: dict[int, tuple[list, list]] = {}
        at = 0
        for r, head, n in owners:
            tokens: list = [(None, r.origin_input_ids[0])] if head else []
            tops: list = [None] if head else []
            k = r.top_logprobs_num
            for row, t in zip(table[at: at + n], targets[at: at + n]):
                # an image's pad ids are past the vocabulary: no logprob
                tokens.append((row[0] if t < vocab else None, t))
                tops.append(list(zip(row[1: 1 + k], (int(i) for i in row[1 + k_max: 1 + k_max + k])))
                            if k else None)
            at += n
            out[id(r)] = (tokens, tops)
        return out

    # ---- decode ----------------------------------------------------------------------------------------
    def _run_decode(self) -> None:
        t0 = time.perf_counter()
        self._decode_round()
        self.counters.decode_seconds += time.perf_counter() - t0

    def _decode_round(self) -> None:
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
        t0 = time.perf_counter()
        spec = self._decode_spec(reqs, [r.output_ids[-1] for r in reqs], groups=groups)
        self._phase("build", t0)
        hidden = self._forward(spec, reqs)
        if hidden is None:
            return
        self.counters.decode_steps += 1
        for r in reqs:
            r.kv_len += 1
        if not (self.overlap and all(_overlap_ok(r) for r in reqs) and self._launch(reqs, hidden)):
            self._sample_and_advance(reqs, hidden, None)
        self.new_token_ratio = max(self.new_token_ratio - 0.002, self.config.min_new_token_ratio)

    # ---- overlap scheduling ------------------------------------------------------------------------------
    # A decode step's sampled tokens stay on the device and feed the next step's forward directly; the host
    # appends them (finish checks, detokenizing, callbacks) while the device runs that next step. So a
    # request that finishes (EOS, a stop string) is seen one step late: it rides one extra step whose KV is
    # real (its last token's) and whose token is dropped. Only plain decode continues this way: anything that
    # needs the previous token on the host first (a grammar mask, penalties, min_new_tokens, a prefill,
    # admission, aborts, retraction) waits for it (`_resolve_pending`), and the next step runs as before.

    def _launch(self, reqs: list[Req], hidden: Any) -> bool:
        """Sample this step on the device and leave it pending. False when sampling raised (the caller then
        samples synchronously, request by request)."""
        t0 = time.perf_counter()
        try:
            out = sample_on_device(self.runner.logits(hidden, None), reqs, self.eos_ids, self.generator)
        except Exception:
            return False
        finally:
            self._phase("sample", t0)
        self._pending = _Pending(reqs, out)
        return True

    def _overlap_batch(self) -> list[Req] | None:
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
        if not nxt or any(not _overlap_ok(r) or r.kv_len + 2 >= ctx for r in nxt):
            return None
        short = len(nxt) - self.kv_pool.available
        if short > 0:
            self.tree.evict(short)
            if len(nxt) > self.kv_pool.available:
                return None
        return nxt

    def _decode_overlapped(self, reqs: list[Req]) -> None:
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

    def _resolve_pending(self) -> None:
        """Bring the pending decode step's tokens to the host and advance its requests."""
        prev, self._pending = self._pending, None
        if prev is not None:
            t0 = time.perf_counter()
            self._advance(prev.reqs, self._to_host(prev.out))
            self.counters.decode_seconds += time.perf_counter() - t0

    def _to_host(self, out: DeviceSample) -> SampleOutput:
        t0 = time.perf_counter()
        host = out.to_host()
        self._phase("sample", t0)
        return host

    def _decode_spec(self, reqs: list[Req], input_ids: list[int], groups: Any = None,
                     input_ids_device: torch.Tensor | None = None) -> BatchSpec:
        """One new KV slot per request (room was ensured), written into their rows, and the decode batch over
        them. No device sync (the rows and positions go up through pinned memory)."""
        slots = self.kv.alloc(len(reqs))
        assert slots is not None, "decode room was ensured"
        self.kv.write_next(reqs, slots)
        rows, kv_lens = [r.req_pool_idx for r in reqs], [r.kv_len for r in reqs]
        return BatchSpec(input_ids=input_ids, out_cache_loc=slots, req_pool_indices=rows,  # type: ignore[arg-type]
                         prefix_lens=kv_lens, extend_lens=[1] * len(reqs), groups=groups,  # type: ignore[arg-type]
                         input_ids_device=input_ids_device)

    def _make_room_for_decode(self) -> None:
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

    def _retract(self, req: Req) -> None:
        self.kv.release(req, cache=True)
        self.active.remove(req)
        req.status = ReqStatus.WAITING
        req.num_retractions += 1
        self.counters.retractions += 1
        self.waiting.insert(0, req)
        self.new_token_ratio = min(1.0, self.new_token_ratio + 0.1)
        self.events.emit("request", {"rid": req.rid, "state": "retracted"})

    # ---- sampling and finishing ------------------------------------------------------------------------
    def _sample_and_advance(self, reqs: list[Req], hidden: Any, rows: list[int] | None) -> None:
        """Sample the next token of each request from `rows` of the forward's hidden states (all when None)."""
        t0 = time.perf_counter()
        try:
            out = sample(self.runner.logits(hidden, rows), reqs, self.eos_ids, self.generator,
                         self._grammar_mask(reqs))
        except Exception:  # something one request asked for that validation did not foresee: find it
            out = self._sample_one_by_one(reqs, hidden, rows)
            keep = [i for i, r in enumerate(reqs) if not r.finished]
            reqs = [reqs[i] for i in keep]
            out = SampleOutput([out.token_ids[i] for i in keep],
                               None if out.logprobs is None else [out.logprobs[i] for i in keep],
                               None if out.top_logprobs is None else [out.top_logprobs[i] for i in keep])
        self._phase("sample", t0)
        self._advance(reqs, out)

    def _advance(self, reqs: list[Req], out: SampleOutput) -> None:
        """Append each request's sampled token, then finish, jump forward or tell its caller. A request that
        finished meanwhile (aborted while its step was in flight, under overlap scheduling) is skipped."""
        now = t0 = time.perf_counter()
        live = [i for i, r in enumerate(reqs) if not r.finished]
        self.counters.generated_tokens += len(live)
        self.counters.recent.append((now, len(live), 0))
        for i in live:
            r = reqs[i]
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
                if not r.finished:
                    self._notify(r)
            except Exception as e:
                self._fail(r, e)
        self._phase("advance", t0)

    def _sample_one_by_one(self, reqs: list[Req], hidden: Any, rows: list[int] | None) -> SampleOutput:
        """The batch's sampling again, each request alone (its own logits row): a request whose sampling raises
        fails by itself, the others get their tokens. Failed requests are finished; their entries are
        placeholders the caller drops."""
        ids: list[int] = []
        lps: list[float | None] = []
        tops: list[list[tuple[float, int]] | None] = []
        for i, r in enumerate(reqs):
            row = i if rows is None else rows[i]
            try:
                one = sample(self.runner.logits(hidden, [row]), [r], self.eos_ids, self.generator,
                             self._grammar_mask([r]))
            except Exception as e:
                self._fail(r, e)
                ids.append(-1)
                lps.append(None)
                tops.append(None)
                continue
            ids.append(one.token_ids[0])
            lps.append(one.logprobs[0] if one.logprobs else None)
            tops.append(one.top_logprobs[0] if one.top_logprobs else None)
        return SampleOutput(ids, lps, tops)

    def _grammar_mask(self, reqs: list[Req]) -> Callable[[torch.Tensor], None] | None:
        rows = [i for i, r in enumerate(reqs) if r.grammar is not None]
        if not rows:
            return None
        from sgnb.engine.grammar import apply_bitmask

        backend = self.grammar()
        bitmask = backend.allocate_bitmask(len(reqs))
        backend.fill_bitmasks([reqs[i].grammar for i in rows], bitmask, rows)
        for i in rows:  # a budget's last token closes the value when one token can (no string cut off mid-way)
            if reqs[i].remaining_new_tokens() == 1:
                reqs[i].grammar.close_in_one(bitmask, i)
        # filled on the host; the logits may be on a GPU
        return lambda logits: apply_bitmask(logits, bitmask.to(logits.device, non_blocking=True), rows)

    def _jump_forward(self, req: Req) -> None:
        """The grammar admits one continuation: append its canonical tokens now (re-tokenizing the last few
        generated tokens with it), to be computed by one extend next round instead of one decode each."""
        t0 = time.perf_counter()
        try:
            self._jump_forward_one(req)
        finally:
            self._phase("jump_forward", t0)

    def _jump_forward_one(self, req: Req) -> None:
        fill_len = req.fill_len
        growth = min(req.remaining_new_tokens(), self.runner.context_length - 1 - fill_len) - 1
        if growth <= 0:
            return
        from sgnb.engine.grammar import jump_forward

        jf = jump_forward(req.grammar, req.output_ids, self.tokenizer,
                          max_rollback=min(4, fill_len - max(req.cached_len, req.rollback_floor)),
                          max_growth=growth)
        if jf is None:
            return
        k = jf.rollback_tokens
        if k:  # drop the last k tokens; the newest had no KV yet, the other k - 1 did (request-owned)
            self.kv.truncate(req, fill_len - k)
            del req.output_ids[-k:], req.forced[-k:]
            if req.return_logprob:
                del req.output_token_logprobs[-k:], req.output_top_logprobs[-k:]
        self._append_forced(req, jf.forced_ids)
        self._set_text(req)
        if self._check_stop_strings(req):
            return
        if req.grammar.stop_is_forced():  # the forced text completed the grammar: no forward needed
            self._finish(req, {"type": "stop", "matched": self.eos_ids[0]})
            return
        req.status = ReqStatus.EXTENDING

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
        self._advance_text(req)
        if self._check_stop_strings(req):
            return
        if n_out >= sp.max_new_tokens:
            self._set_text(req)
            self._finish(req, {"type": "length", "length": sp.max_new_tokens})
        elif req.kv_len + 1 >= self.runner.context_length:
            self._set_text(req)
            self._finish(req, {"type": "length", "length": n_out, "message": "context length reached"})

    def _advance_text(self, req: Req) -> None:
        """Append the text of the newest tokens to req.text (incremental detokenization: a step costs its own
        tokens, not the whole output; an incomplete UTF-8 character waits for the token that completes it)."""
        new, req.detok_prefix, req.detok_read = self.tokenizer.decode_incremental(
            req.output_ids, req.detok_prefix, req.detok_read, skip_special_tokens=req.sampling.skip_special_tokens)
        req.text += new

    def _set_text(self, req: Req) -> None:
        """req.text = the exact text of the whole output (at the end, or after jump-forward rewrote tokens)."""
        req.text = self.decode(req.output_ids, req.sampling.skip_special_tokens)
        req.detok_read = len(req.output_ids)
        req.detok_prefix = max(req.detok_read - DETOK_CONTEXT, 0)

    def _check_stop_strings(self, req: Req) -> bool:
        """Finish the request if its text holds a stop string or stop regex match (trimmed off, in the exact
        text). Only the text a stop could newly end in is searched (`engine/stops.py`: RE2 for regexes, in a
        bounded window), so a step's cost does not grow with the output or depend on the pattern."""
        sp = req.sampling
        if len(req.output_ids) < sp.min_new_tokens:
            return False
        text = req.text
        if has_stop(text, sp.stop, sp.stop_regex, req.stop_scan):
            self._set_text(req)  # the exact text (the incremental one may hold back a partial character)
            start = regex_window_start(req.stop_scan)
            exact = req.text if first_stop(req.text, sp.stop, sp.stop_regex, start) else text
            pos, matched = first_stop(exact, sp.stop, sp.stop_regex, start)  # type: ignore[misc]
            req.text = exact if sp.no_stop_trim else exact[:pos]
            self._finish(req, {"type": "stop", "matched": matched})
            return True
        req.stop_scan = len(text)
        return False

    def _finish(self, req: Req, reason: dict[str, Any], cache: bool = True) -> None:
        """End the request: release its KV (to the tree when cache), then leave the queues, then tell the
        caller (in that order: an observer never sees an idle engine with this request's locks held)."""
        req.finish_reason = reason
        req.finished_time = time.perf_counter()
        self.kv.release(req, cache=cache)
        req.new_slots = None
        if req.status is ReqStatus.WAITING:
            if req in self.waiting:
                self.waiting.remove(req)
        elif req in self.active:
            self.active.remove(req)
        req.status = ReqStatus.FINISHED
        with self._rid_lock:
            self._rids.discard(req.rid)
        c = self.counters
        if reason["type"] == "abort":
            c.requests_aborted += 1
        else:
            c.requests_finished += 1
        self.events.emit("request", {"rid": req.rid, "state": "finished", "reason": reason["type"],
                                     "completion_tokens": len(req.output_ids)})
        self._notify(req)

    def _notify(self, req: Req) -> None:
        """Tell the request's caller (its on_update callback). A caller that has gone away (a closed event loop:
        a stopped notebook server thread; a broken queue) is detached and its request aborted, here in the
        scheduler thread: a client's failure never reaches the engine or other requests."""
        callback = req.on_update
        if callback is None:
            return
        try:
            callback(req)
        except Exception as e:
            req.on_update = None
            log.warning("request %s: its caller's callback failed (%r); detached", req.rid, e)
            if not req.finished:
                self._finish(req, {"type": "abort", "message": f"the caller went away: {type(e).__name__}: {e}"},
                             cache=False)

    def _fail(self, req: Req, exc: BaseException) -> None:
        log.warning("request %s failed: %r", req.rid, exc)
        req.error = exc
        self.counters.requests_failed += 1
        self._finish(req, {"type": "abort", "message": f"{type(exc).__name__}: {exc}"}, cache=False)

    def _apply_aborts(self) -> None:
        if not self._aborts:
            return
        for req in self._live():
            if req.rid in self._aborts and not req.finished:
                self._finish(req, {"type": "abort", "message": "aborted"})
        self._aborts.clear()

    def _flush_now(self) -> None:
        self.tree.evict(self.tree.total_size)
        assert self.tree.total_size == 0 and self.kv_pool.available == self.kv_pool.size
        self.tree.reset()
        self.kv_pool.clear()
        for fut in self._pending_flush:
            fut.set_result(True)
        self._pending_flush = []


class _Pending:
    """A decode step whose sampled tokens are still on the device (overlap scheduling)."""

    def __init__(self, reqs: list[Req], out: DeviceSample) -> None:
        self.reqs = reqs
        self.out = out
        self.index = {id(r): i for i, r in enumerate(reqs)}


def _overlap_ok(req: Req) -> bool:
    """Whether a request's next token can be sampled before its previous one is on the host: nothing in its
    sampling reads its output so far (a grammar, penalties, a min_new_tokens ban still in force)."""
    sp = req.sampling
    return (req.grammar is None and sp.repetition_penalty == 1.0 and not sp.frequency_penalty
            and not sp.presence_penalty and len(req.output_ids) >= sp.min_new_tokens)
