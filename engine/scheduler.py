"""Scheduler: the engine's background thread. Continuous batching over the radix cache.

Each loop: take new requests and aborts, then run either one prefill batch (admission.py: continuations of
admitted requests, then waiting requests in policy order) or one decode step for every running request
(retracting requests when KV runs out). Requests are either `waiting` (the admission queue) or `active`
(admitted: their `status` says whether they decode, continue a chunked prompt or extend forced tokens).
KV slots change owners only through kv_manager.py. Everything that touches the KV pool and the tree runs on
this thread.
"""

from __future__ import annotations

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

from sgnb.engine.config import EngineConfig
from sgnb.engine.decode import DecodeRounds, PendingStep
from sgnb.engine.device_time import DeviceTime
from sgnb.engine.events import EventBus
from sgnb.engine.finishing import Finishing
from sgnb.engine.forward_batch import BatchSpec
from sgnb.engine.kv_manager import KVManager
from sgnb.engine.media import EncoderCache
from sgnb.engine.model_runner import Runner
from sgnb.engine.prefill import PendingPrefill, PrefillRounds
from sgnb.engine.radix_cache import RadixCache
from sgnb.engine.request import Req, ReqStatus
from sgnb.engine.tokenizer import Tokenizer

if TYPE_CHECKING:  # xgrammar loads only once a request is constrained (it imports transformers: ~1.5 s)
    from sgnb.engine.grammar import GrammarBackend

log = logging.getLogger("sgnb.engine")

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
# jump_forward: the part of advance spent on jump-forward; logprobs: a prefill's prompt logprobs (a select's
# scores: the LM head on the prompt's rows, log_softmax, top-k, and their copy to the host, which on a GPU waits
# for the forward); cache: the rest of a prefill's bookkeeping (the tree's share of a computed chunk, adopting a
# lender's prefix); idle: waiting for requests (the inbox) or for room. Counters.phase_cpu holds the thread's
# CPU time in the same intervals: a phase's wall less its CPU is what it waited for (the GIL, or the device)
PHASES = ("admit", "build", "forward", "sample", "advance", "jump_forward", "logprobs", "cache", "idle")


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
    overlapped_prefills: int = 0  # prefill batches launched before the previous batch's results reached the host
    follow_up_waits: int = 0  # waits for told callers' next requests before an admission (follow_up_wait_s)
    mixed_batches: int = 0  # prefill forwards that running requests' decode steps rode along with
    encoded_items: int = 0  # images / videos run through the encoder (cache misses)
    encoder_seconds: float = 0.0
    recent: deque = field(default_factory=lambda: deque(maxlen=256))  # (time, generated, prefilled)
    # the scheduler thread's own CPU time (time.thread_time, absolute): its wall time in rounds less this is time
    # it waited, for the GIL or for the device
    thread_cpu_seconds: float = 0.0
    # the scheduler thread's wall time by phase (see Scheduler._phase): where a round's host time goes
    phases: dict = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    # its CPU time (time.thread_time) in the same intervals: a phase's wall less this is what it waited for, the
    # interpreter lock (program threads) or the device
    phase_cpu: dict = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))

class Scheduler(PrefillRounds, DecodeRounds, Finishing):
    """The engine's thread: its state, the thread-safe entry points, the loop and one round (`step`). The
    rounds' parts live beside it: prefill.py (admission and prefill), decode.py (decode steps and their
    overlap), finishing.py (sampling, appending, finishing requests)."""

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
        self.new_token_ratio: float = config.init_new_token_ratio
        self.counters: Counters = Counters()
        self._cpu_mark = 0.0  # the thread's CPU clock where the current phase began (see _now)
        # how long the device computed (forwards, sampling, prompt logprobs): against the wall, its idle time
        self.device_time: DeviceTime = DeviceTime(runner.device.type == "cuda" and config.tp_size == 1 and not config.tp_workers)
        self.generator: torch.Generator = torch.Generator(device=runner.device).manual_seed(config.random_seed)
        self._pending_flush: list[Future] = []
        self._stop = False
        self._aborts: dict[int, Req] = {}  # id -> the request an abort names (not its rid: see abort)
        self.thread = threading.Thread(target=self._run, name="sgnb-scheduler", daemon=True)
        self.fatal: BaseException | None = None
        self._rids: dict[str, Req] = {}  # rid -> the request submitted under it, not finished nor aborted
        # overlap scheduling (see _launch): on CUDA in this process unless disabled; forced on for tests
        overlap = config.disable_overlap_schedule
        self.overlap: bool = (runner.device.type == "cuda" and getattr(runner, "supports_overlap", False)
                        if overlap is None else not overlap)
        self._pending: PendingStep | None = None  # a decode step whose tokens are still on the device
        # a prefill batch whose results are still on the device while the next one runs (config.overlap_prefill;
        # the in-process runner only: the hidden states must outlive the next forward)
        flag = config.overlap_prefill
        self.overlap_prefill: bool = (self.overlap and getattr(runner, "supports_overlap", False)
                                      and (runner.device.type == "cuda" if flag is None else flag))
        self._pending_prefill: PendingPrefill | None = None
        # with config.follow_up_wait_s: the requests whose callers the batch being read tells at its end
        # (Finishing._callers_told_after), and how many told callers' requests had ended since the last wait
        self._told_after = None
        self._follow_ups = 0
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
            self._rids.update((r.rid, r) for r in reqs)
        for req in reqs:
            self.inbox.put(("req", req))

    def abort(self, rid: str) -> None:
        """Abort the request in flight under `rid` (any thread). Its rid is free again at once: an interrupted
        caller may resubmit under the same rid right away, and the abort (queued before that request) ends only
        the old one."""
        with self._rid_lock:
            req = self._rids.pop(rid, None)
        if req is not None:
            self.inbox.put(("abort", req))

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
        self.device_time = DeviceTime(self.device_time.cuda)
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
                if self._follow_ups:
                    self._await_follow_ups()
                if self._stop:
                    break
                self._apply_aborts()
                if self._pending_flush and not self.busy:
                    self._resolve_pending()  # a step (or a prefill batch) of aborted requests may still be pending
                    self._resolve_pending_prefill()
                    self._flush_now()
                ran = self.step()
                self.counters.thread_cpu_seconds = time.thread_time()  # the scheduler thread's CPU time so far
                if not ran and self.busy:
                    t0 = self._now()
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
        if self._pending_prefill is not None:
            t0 = self._now()
            pending, self._pending_prefill = self._pending_prefill, None
            batch = self._overlap_prefill_batch(pending)
            self._phase("admit", t0)
            if batch:  # launched before the pending batch's results are read: the device runs it meanwhile
                self.counters.overlapped_prefills += 1
                launched = self._launch_prefill(batch)
                self._resolve_prefill(pending)
                self._hold_or_resolve(launched)
                return True
            self._resolve_prefill(pending)
        if self._pending is not None:
            nxt = self._overlap_batch()
            if nxt is not None:
                t0 = time.perf_counter()
                self._decode_overlapped(nxt)
                self.counters.decode_seconds += time.perf_counter() - t0
                return True
            self._resolve_pending()
        t0 = self._now()
        batch = self._admit()
        self._phase("admit", t0)
        if batch:
            self._run_prefill(batch)
            return True
        if any(r.status is ReqStatus.RUNNING for r in self.active):
            self._run_decode()
            return True
        return False

    def _resolve_pending_prefill(self) -> None:
        pending, self._pending_prefill = self._pending_prefill, None
        if pending is not None:
            self._resolve_prefill(pending)

    def _now(self) -> float:
        """The start of a phase: time.perf_counter(), with the thread's CPU clock noted for `_phase`."""
        self._cpu_mark = time.thread_time()
        return time.perf_counter()

    def _phase(self, name: str, t0: float) -> float:
        """Count the wall time since t0 (from `_now` or the previous `_phase`) to a phase of Counters.phases, and
        the thread's CPU time since then to Counters.phase_cpu; returns now, the start of the next phase."""
        now, cpu = time.perf_counter(), time.thread_time()
        self.counters.phases[name] += now - t0
        self.counters.phase_cpu[name] += cpu - self._cpu_mark
        self._cpu_mark = cpu
        return now

    def _drain_inbox(self, block: bool) -> None:
        t0 = self._now()
        try:
            item = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
        except queue.Empty:
            if block:
                self._phase("idle", t0)
            return
        if block:
            self._phase("idle", t0)
        while True:
            self._take(item)
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _await_follow_ups(self) -> None:
        """Callers whose requests ended were just told (config.follow_up_wait_s): their threads' next requests
        are taken in before the next admission, waiting at most follow_up_wait_s and no longer than a tenth of
        it without a new arrival (the woken threads are done or blocked). Under overlap scheduling the device
        still runs the launched batch meanwhile."""
        self._follow_ups = 0
        wait = self.config.follow_up_wait_s
        t0 = self._now()
        deadline = t0 + wait
        while not self._stop:
            left = deadline - time.perf_counter()
            if left <= 0:
                break
            try:
                item = self.inbox.get(timeout=min(left, wait / 10))
            except queue.Empty:
                break
            self._take(item)
        self.counters.follow_up_waits += 1
        self._phase("idle", t0)

    def _take(self, item: tuple[str, Any]) -> None:
        """One inbox item into the scheduler's state: a request queued, an abort or flush noted, or the stop."""
        kind, payload = item
        if kind == "req":
            self.waiting.append(payload)
            self.counters.prompt_tokens += len(payload.origin_input_ids)
            # input_ids is the request's own list (no copy): benchmarks compute the optimal hit rate from it
            self.events.emit("request", {"rid": payload.rid, "state": "queued",
                                         "prompt_tokens": len(payload.origin_input_ids),
                                         "input_ids": payload.origin_input_ids})
        elif kind == "abort":
            self._aborts[id(payload)] = payload
        elif kind == "flush":
            self._pending_flush.append(payload)
        elif kind == "stop":
            self._stop = True

    def _groups(self, reqs: list[Req]) -> tuple[list[int], list[tuple[int, int, int]] | None]:
        """An order of the batch that puts requests sharing a cached prefix together, and those groups (see
        KVManager.group_by_prefix); the identity and None when nothing can be shared."""
        if len(reqs) < 2 or self.tree.disable or self.config.disable_cascade:
            return list(range(len(reqs))), None
        order, groups = self.kv.group_by_prefix(reqs, MIN_SHARED_PREFIX)
        if all(shared == 0 for _, _, shared in groups):
            return list(range(len(reqs))), None
        return order, groups

    def _forward(self, spec: BatchSpec, reqs: list[Req]) -> Any:
        """Run the model (cascade attention over the batch's shared prefix). A failure fails these requests
        only: their new slots are already in their rows, so count them in before releasing."""
        # a graph replay reads every request's whole key range: the shared prefix is worked out (a walk of
        # every request's tree path, each step) only for forwards that run eagerly
        cascade = not self.config.disable_cascade and not self.runner.replays_graph(spec)
        shared = self.kv.shared_prefix_len(reqs) if cascade else 0
        spec.shared_len = shared if shared >= MIN_SHARED_PREFIX else 0
        t0 = self._now()
        try:
            with self.device_time.span():
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
        dt = self._phase("forward", t0) - t0
        c = self.counters
        c.forward_seconds += dt
        if not spec.graphed:
            c.eager_forwards += 1
            c.eager_seconds += dt
        if len(c.slowest) < SLOWEST_KEPT or dt > c.slowest[-1][0]:
            # a new list, not sorted in place: get_stats() reads it from other threads (an in-place sort shows
            # them an empty list meanwhile)
            c.slowest = sorted([*c.slowest, (dt, describe_forward(spec))], key=lambda x: -x[0])[:SLOWEST_KEPT]
        return hidden

    # ---- aborts and flushes ---------------------------------------------------------------------------
    def _apply_aborts(self) -> None:
        if not self._aborts:
            return
        # a pending prefill batch is read first: an abort then meets its requests with their results in (their
        # prompt logprobs, first tokens), as without overlap_prefill
        self._resolve_pending_prefill()
        for req in self._live():
            if id(req) in self._aborts and not req.finished:
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
