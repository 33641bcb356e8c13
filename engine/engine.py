"""Engine: the in-process runtime, compatible with SGLang's offline `sgl.Engine`.

    engine = Engine(model_path="smollm2")
    out = engine.generate("The capital of France is", {"max_new_tokens": 8, "temperature": 0})
    out["text"], out["meta_info"]["cached_tokens"]

All public methods are thread-safe; requests run on a background scheduler thread, so calls never touch an
asyncio loop (Jupyter's is already running). `async_generate` / `async_score` are awaitable variants.
Bad input raises (TypeError / ValueError) in the calling thread before any model work. A request that fails
inside the engine comes back with finish_reason {"type": "abort", "message": ...}; the engine stays usable.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import queue
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import torch

from sgnb.engine.config import EngineConfig
from sgnb.engine.events import Event, EventBus
from sgnb.engine.model_loader import load_tokenizer, resolve_model
from sgnb.engine.model_runner import Runner, make_runner
from sgnb.engine.radix_cache import RadixCache
from sgnb.engine.request import Req, ReqStatus
from sgnb.engine.sampling_params import SamplingParams
from sgnb.engine.scheduler import Scheduler
from sgnb.engine.scoring import check_choices, choose, score_start

Prompt = str | list[str] | None
InputIds = list[int] | list[list[int]] | None
_STREAM_END = object()


class EngineError(RuntimeError):
    """The engine can no longer serve (its scheduler thread died)."""


class Engine:
    def __init__(self, model_path: str = "smollm2", **kwargs: Any) -> None:
        self.config = EngineConfig.from_kwargs(model_path=model_path, **kwargs)
        t0 = time.perf_counter()
        self.source = resolve_model(self.config.model_path, self.config.cache_dir)
        self.tokenizer = load_tokenizer(self.source, self.config.cache_dir, self.config.tokenizer_path)
        self.runner: Runner = make_runner(self.config, self.source)  # tp_size > 1: worker processes
        try:
            self.events = EventBus(self.config.event_history)
            self.tree = RadixCache(self.runner.kv_pool.free, self.runner.device, self.config.disable_radix_cache,
                                   emit=self.events.emit)
            eos = tuple(self.tokenizer.eos_token_ids) or tuple(self.source.config.eos_token_ids)
            self._grammar_backend: Any = None
            self._grammar_lock = threading.Lock()
            self.scheduler = Scheduler(self.config, self.runner, self.tree, self.events, eos, self.tokenizer,
                                       self.grammar_backend)
            self.scheduler.start()
        except BaseException:
            self.runner.shutdown()
            raise
        # stop the thread (and any workers) at exit or when the engine is collected (a daemon thread dying
        # inside torch aborts)
        self._finalizer = weakref.finalize(self, _stop, self.scheduler, self.runner)
        self.load_seconds = time.perf_counter() - t0
        self._ids = itertools.count()
        self._closed = False

    # ---- properties --------------------------------------------------------------------------------------
    @property
    def is_alive(self) -> bool:
        """False once shut down, or if the scheduler thread or a tensor-parallel worker died."""
        return (not self._closed and self.scheduler.fatal is None and self.scheduler.thread.is_alive()
                and self.runner.failure() is None)

    @property
    def context_length(self) -> int:
        return self.runner.context_length

    @property
    def model_name(self) -> str:
        return self.source.name

    def grammar_backend(self) -> Any:
        """The structured-output compiler (xgrammar), made on first use: unconstrained work never loads it."""
        with self._grammar_lock:
            if self._grammar_backend is None:
                from sgnb.engine.grammar import GrammarBackend

                self._grammar_backend = GrammarBackend(self.tokenizer, self.source.config.vocab_size)
            return self._grammar_backend

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)

    # ---- requests ----------------------------------------------------------------------------------------
    def _check_open(self, workers: bool = True) -> None:
        """Raise EngineError if the engine cannot serve. Waits for submitted requests pass workers=False: a
        worker failure then reaches them as their own failure (finish_reason abort, meta_info error)."""
        if self._closed:
            raise EngineError("the engine was shut down")
        if self.scheduler.fatal is not None:
            raise EngineError(f"the engine's scheduler died: {self.scheduler.fatal!r}")
        failure = self.runner.failure() if workers else None
        if failure is not None:
            raise EngineError(f"the engine's model workers failed: {failure}") from failure

    def _tokens(self, prompt: str | None, input_ids: Sequence[int] | None) -> list[int]:
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt or input_ids")
        vocab = self.source.config.vocab_size
        if prompt is not None:
            if not isinstance(prompt, str):
                raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
            ids = self.tokenizer.encode(prompt)
            if ids and max(ids) >= vocab:
                raise ValueError(
                    f"the tokenizer turned this prompt into ids up to {max(ids)}, outside the model's vocabulary "
                    f"[0, {vocab}): the tokenizer ({self.tokenizer.vocab_size} ids) does not fit this model"
                    + (". Dummy models use the SmolLM2 tokenizer: for text prompts pick one whose vocabulary "
                       "holds it (dummy:tiny, dummy:llama-2-7b-smolvocab, dummy:llama-3-8b) or pass input_ids"
                       if self.source.dummy else ""))
        else:
            ids = [int(t) for t in input_ids]  # type: ignore[union-attr]
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"input_ids holds ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        if not ids:
            raise ValueError("the prompt is empty: give at least one token")
        limit = min(self.context_length, self.runner.kv_pool.size)
        if len(ids) >= limit:
            raise ValueError(f"the prompt has {len(ids)} tokens; this engine takes at most {limit - 1} "
                             f"(context length {self.context_length}, KV pool {self.runner.kv_pool.size} tokens)")
        return ids

    def _make_reqs(self, prompt: Prompt, input_ids: InputIds, sampling_params: dict | list[dict] | None,
                   return_logprob: bool | list[bool], logprob_start_len: int | list[int],
                   top_logprobs_num: int | list[int], rid: str | list[str] | None) -> tuple[list[Req], bool]:
        """Validate everything and build the requests (n > 1 expands in place). Nothing is submitted here."""
        batched = isinstance(prompt, list) or (isinstance(input_ids, list) and bool(input_ids)
                                               and isinstance(input_ids[0], list))
        if batched:
            count = len(prompt) if prompt is not None else len(input_ids)  # type: ignore[arg-type]
            if count == 0:
                raise ValueError("an empty batch of prompts")
            prompts = list(prompt) if prompt is not None else [None] * count
            id_lists = list(input_ids) if input_ids is not None else [None] * count  # type: ignore[arg-type]
        else:
            count, prompts, id_lists = 1, [prompt], [input_ids]

        def per_item(value: Any, name: str) -> list[Any]:
            if isinstance(value, list):
                if len(value) != count:
                    raise ValueError(f"{name} has {len(value)} entries for {count} prompts")
                return value
            return [value] * count

        params = per_item(sampling_params, "sampling_params")
        lps, starts, tops = (per_item(return_logprob, "return_logprob"),
                             per_item(logprob_start_len, "logprob_start_len"),
                             per_item(top_logprobs_num, "top_logprobs_num"))
        rids = per_item(rid, "rid") if isinstance(rid, list) else [rid] * count
        reqs: list[Req] = []
        for i in range(count):
            ids = self._tokens(prompts[i], id_lists[i])  # type: ignore[arg-type]
            sp = SamplingParams.from_dict(params[i])
            grammar_future = None
            if sp.regex is not None or sp.json_schema is not None or sp.ebnf is not None:
                from sgnb.engine.grammar import constraint_of

                kind, source = constraint_of(sp)  # type: ignore[misc]
                backend = self.grammar_backend()
                backend.validate(kind, source)  # an invalid constraint fails here, with the parser's message
                grammar_future = backend.compile_async(kind, source)  # off the scheduler's critical path
            room = self.context_length - len(ids)
            if sp.max_new_tokens > room:
                sp = dataclasses.replace(sp, max_new_tokens=room, min_new_tokens=min(sp.min_new_tokens, room))
            start = int(starts[i])
            if lps[i] and start >= len(ids):
                raise ValueError(f"logprob_start_len={start} must be < the prompt length {len(ids)} (or -1)")
            if int(tops[i]) < 0:
                raise ValueError("top_logprobs_num must be >= 0")
            base = rids[i] or uuid.uuid4().hex[:12]
            for j in range(sp.n):
                req = Req(base if sp.n == 1 else f"{base}-{j}", ids, dataclasses.replace(sp, n=1),
                          return_logprob=bool(lps[i]), logprob_start_len=start, top_logprobs_num=int(tops[i]))
                req.grammar_future = grammar_future
                if sp.seed is not None:
                    req.generator = torch.Generator(device=self.runner.device).manual_seed(sp.seed + j)
                reqs.append(req)
        return reqs, batched or len(reqs) > 1

    def generate(self, prompt: Prompt = None, sampling_params: dict | list[dict] | None = None,
                 input_ids: InputIds = None, return_logprob: bool | list[bool] = False,
                 logprob_start_len: int | list[int] = -1, top_logprobs_num: int | list[int] = 0,
                 return_text_in_logprobs: bool = False, stream: bool = False,
                 rid: str | list[str] | None = None) -> dict | list[dict] | Iterator[dict]:
        """Generate for one prompt (-> dict) or a list (-> list of dicts, n samples per prompt in order).

        With stream=True (one prompt, n=1) returns an iterator of dicts whose "text" is the new text since the
        previous chunk; the last chunk carries the full meta_info. Interrupting the wait (KeyboardInterrupt)
        aborts the requests, which frees their KV and cache locks.
        """
        self._check_open()
        reqs, many = self._make_reqs(prompt, input_ids, sampling_params, return_logprob, logprob_start_len,
                                     top_logprobs_num, rid)
        if stream:
            if many:
                raise ValueError("stream=True takes one prompt with n=1")
            return self._stream(reqs[0], return_text_in_logprobs)
        done = [threading.Event() for _ in reqs]
        for req, ev in zip(reqs, done):
            req.on_update = lambda r, ev=ev: ev.set() if r.finished else None
            self.scheduler.submit(req)
        try:
            for ev in done:
                while not ev.wait(0.1):
                    self._check_open(workers=False)
        except BaseException:
            for req in reqs:
                self.scheduler.abort(req.rid)
            raise
        outs = [self._result(r, return_text_in_logprobs) for r in reqs]
        return outs if many else outs[0]

    def _stream(self, req: Req, text_in_logprobs: bool) -> Iterator[dict]:
        chunks: queue.Queue = queue.Queue()
        req.on_update = chunks.put
        self.scheduler.submit(req)
        sent = 0
        try:
            while True:
                try:
                    r = chunks.get(timeout=0.1)
                except queue.Empty:
                    self._check_open(workers=False)
                    continue
                if r.finished:
                    out = self._result(r, text_in_logprobs)
                    out["text"] = r.text[sent:]
                    yield out
                    return
                safe = _stream_safe_len(r.text, r.sampling.stop)
                if safe > sent:
                    yield {"text": r.text[sent:safe], "meta_info": {"id": r.rid, "completion_tokens": len(r.output_ids)}}
                    sent = safe
        finally:
            if not req.finished:
                self.scheduler.abort(req.rid)

    async def async_generate(self, prompt: Prompt = None, sampling_params: dict | list[dict] | None = None,
                             input_ids: InputIds = None, return_logprob: bool | list[bool] = False,
                             logprob_start_len: int | list[int] = -1, top_logprobs_num: int | list[int] = 0,
                             return_text_in_logprobs: bool = False, stream: bool = False,
                             rid: str | list[str] | None = None) -> dict | list[dict] | AsyncIterator[dict]:
        """Awaitable generate; with stream=True returns an async iterator. Cancelling aborts the requests."""
        self._check_open()
        reqs, many = self._make_reqs(prompt, input_ids, sampling_params, return_logprob, logprob_start_len,
                                     top_logprobs_num, rid)
        loop = asyncio.get_running_loop()
        if stream:
            if many:
                raise ValueError("stream=True takes one prompt with n=1")
            return self._astream(reqs[0], return_text_in_logprobs, loop)
        futures = [loop.create_future() for _ in reqs]
        for req, fut in zip(reqs, futures):
            def notify(r: Req, fut: asyncio.Future = fut) -> None:
                if r.finished:
                    loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(r))
            req.on_update = notify
            self.scheduler.submit(req)
        try:
            done = await asyncio.gather(*futures)
        except BaseException:
            for req in reqs:
                self.scheduler.abort(req.rid)
            raise
        outs = [self._result(r, return_text_in_logprobs) for r in done]
        return outs if many else outs[0]

    async def _astream(self, req: Req, text_in_logprobs: bool, loop: asyncio.AbstractEventLoop) -> AsyncIterator[dict]:
        chunks: asyncio.Queue = asyncio.Queue()
        req.on_update = lambda r: loop.call_soon_threadsafe(chunks.put_nowait, r.finished)
        self.scheduler.submit(req)
        sent = 0
        try:
            while True:
                finished = await chunks.get()
                if finished:
                    out = self._result(req, text_in_logprobs)
                    out["text"] = req.text[sent:]
                    yield out
                    return
                safe = _stream_safe_len(req.text, req.sampling.stop)
                if safe > sent:
                    yield {"text": req.text[sent:safe], "meta_info": {"id": req.rid}}
                    sent = safe
        finally:
            if not req.finished:
                self.scheduler.abort(req.rid)

    def abort(self, rid: str) -> None:
        """Abort a request by id (queued or running). Its locks and KV slots are released."""
        self.scheduler.abort(rid)

    def _result(self, req: Req, text_in_logprobs: bool) -> dict:
        meta: dict[str, Any] = {
            "id": req.rid,
            "prompt_tokens": len(req.origin_input_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": max(req.cached_tokens, 0),
            "finish_reason": req.finish_reason,
            "e2e_latency": (req.finished_time or time.perf_counter()) - req.created,
        }
        if req.first_token_time is not None:
            meta["ttft"] = req.first_token_time - req.created
        meta["decode_steps"] = req.decode_steps
        meta["forced_tokens"] = sum(req.forced)
        if req.grammar is not None:
            meta["output_forced"] = list(req.forced)
        if req.error is not None:
            meta["error"] = f"{type(req.error).__name__}: {req.error}"
        if req.return_logprob:
            fmt = self._fmt_logprobs
            meta["input_token_logprobs"] = fmt(req.input_token_logprobs, text_in_logprobs)
            meta["output_token_logprobs"] = fmt(req.output_token_logprobs, text_in_logprobs)
            if req.top_logprobs_num:
                meta["input_top_logprobs"] = [None if t is None else fmt(t, text_in_logprobs)
                                              for t in req.input_top_logprobs]
                meta["output_top_logprobs"] = [None if t is None else fmt(t, text_in_logprobs)
                                               for t in req.output_top_logprobs]
        return {"text": req.text, "output_ids": list(req.output_ids), "meta_info": meta}

    def _fmt_logprobs(self, items: list[tuple], with_text: bool) -> list[tuple]:
        tt = self.tokenizer.token_text
        return [(lp, tok, tt(tok) if with_text else None) for lp, tok in items]

    # ---- choice scoring (select) ------------------------------------------------------------------------
    def score(self, prefix: str | list[int], choices: list[str],
              choices_method: str = "token_length_normalized", return_text_in_logprobs: bool = False) -> dict:
        """Score continuations of one prefix (the prefix KV is shared through the radix cache).

        Returns {"index", "choice", "normalized_prompt_logprobs", "input_token_logprobs",
        "unconditional_token_logprobs" (only for unconditional_likelihood_normalized), "cached_tokens"}.
        """
        self._check_open()
        plan = self._score_plan(prefix, choices, choices_method)
        outs = self.generate(input_ids=plan["inputs"], sampling_params={"max_new_tokens": 0},
                             return_logprob=True, logprob_start_len=plan["starts"])
        return self._score_result(plan, outs, choices, choices_method, return_text_in_logprobs)  # type: ignore[arg-type]

    async def async_score(self, prefix: str | list[int], choices: list[str],
                          choices_method: str = "token_length_normalized") -> dict:
        plan = self._score_plan(prefix, choices, choices_method)
        outs = await self.async_generate(input_ids=plan["inputs"], sampling_params={"max_new_tokens": 0},
                                         return_logprob=True, logprob_start_len=plan["starts"])
        return self._score_result(plan, outs, choices, choices_method, False)  # type: ignore[arg-type]

    def _score_plan(self, prefix: str | list[int], choices: list[str], method: str) -> dict:
        check_choices(choices, method)
        if isinstance(prefix, str):
            prefix_ids = self.tokenizer.encode(prefix)
            full = [self.tokenizer.encode(prefix + c) for c in choices]
        else:
            prefix_ids = list(prefix)
            full = [prefix_ids + self.tokenizer.encode(c) for c in choices]
        if not prefix_ids:
            raise ValueError("select needs a non-empty prefix to score choices against")
        start = score_start(prefix_ids, full)
        inputs, starts = [list(f) for f in full], [start] * len(full)
        if method == "unconditional_likelihood_normalized":
            for f in full:  # each choice alone, after the last shared token, as the unconditional context
                inputs.append(f[start - 1:])
                starts.append(1)
        for ids in inputs:
            self._tokens(None, ids)
        return {"inputs": inputs, "starts": starts, "n": len(choices), "start": start}

    def _score_result(self, plan: dict, outs: list[dict], choices: list[str], method: str, with_text: bool) -> dict:
        n = plan["n"]
        for o in outs:
            if o["meta_info"]["finish_reason"]["type"] == "abort":
                raise RuntimeError(f"scoring failed: {o['meta_info'].get('error')}")
        cond = [[lp for lp, _, _ in o["meta_info"]["input_token_logprobs"]] for o in outs[:n]]
        uncond = None
        if method == "unconditional_likelihood_normalized":
            uncond = [[lp for lp, _, _ in o["meta_info"]["input_token_logprobs"]] for o in outs[n:]]
        index, normalized = choose(method, cond, uncond)
        result = {
            "index": index,
            "choice": choices[index],
            "normalized_prompt_logprobs": normalized,
            "input_token_logprobs": [self._fmt_logprobs([(lp, t) for lp, t, _ in o["meta_info"]["input_token_logprobs"]],
                                                        with_text) for o in outs[:n]],
            "cached_tokens": sum(o["meta_info"]["cached_tokens"] for o in outs),
            "prompt_tokens": sum(o["meta_info"]["prompt_tokens"] for o in outs),
        }
        if uncond is not None:
            result["unconditional_token_logprobs"] = uncond
        return result

    # ---- cache and observability ------------------------------------------------------------------------
    def flush_cache(self, timeout: float | None = None) -> bool:
        """Empty the radix cache once no request is in flight (waits for that). Returns True when flushed."""
        self._check_open()
        return bool(self.scheduler.flush().result(timeout=timeout))

    def subscribe(self, callback, replay: bool = False):
        """Receive every engine event (dicts: insert, split, hit, evict, lock, unlock, reset, request).
        Runs on the scheduler thread: be quick. Returns an unsubscribe function."""
        return self.events.subscribe(callback, replay=replay)

    def event_history(self) -> list[Event]:
        return self.events.history()

    def tree_snapshot(self, max_key_tokens: int = 64) -> dict:
        """The live radix tree: {"nodes": [...], "total_tokens", "evictable_tokens", "protected_tokens"}."""
        nodes = self.tree.snapshot(lambda ids: self.tokenizer.decode(ids, False), max_key=max_key_tokens)
        return {"nodes": nodes, "total_tokens": self.tree.total_size, "evictable_tokens": self.tree.evictable_size,
                "protected_tokens": self.tree.protected_size}

    def get_stats(self) -> dict:
        s = self.scheduler
        c = s.counters
        now = time.perf_counter()
        window = [x for x in list(c.recent) if now - x[0] <= 5.0]
        span = max(now - window[0][0], 1e-3) if window else 1.0
        pool = self.runner.kv_pool
        return {
            "model": self.source.name,
            "device": self.runner.placement,
            "attention_backend": self.runner.attention_backend,
            "tp_size": self.config.tp_size,
            "waiting": len(s.waiting) + s.count(ReqStatus.CHUNKED),
            "running": s.count(ReqStatus.RUNNING) + s.count(ReqStatus.EXTENDING),
            "requests_finished": c.requests_finished,
            "requests_aborted": c.requests_aborted,
            "requests_failed": c.requests_failed,
            "prompt_tokens": c.prompt_tokens,
            "cached_tokens": c.cached_tokens,
            "cache_hit_rate": c.cached_tokens / c.prompt_tokens if c.prompt_tokens else 0.0,
            "prefill_tokens": c.prefill_tokens,
            "generated_tokens": c.generated_tokens,
            "decode_steps": c.decode_steps,
            "prefill_batches": c.prefill_batches,
            "retractions": c.retractions,
            "forward_seconds": c.forward_seconds,
            "decode_seconds": c.decode_seconds,
            "cascade_batches": c.cascade_batches,
            "gen_tokens_per_s": sum(x[1] for x in window) / span if window else 0.0,
            "prefill_tokens_per_s": sum(x[2] for x in window) / span if window else 0.0,
            "kv_total": pool.size,
            "kv_free": pool.available,
            "kv_cached": self.tree.total_size,
            "kv_used": pool.size - pool.available,
            "kv_evictable": self.tree.evictable_size,
            "kv_protected": self.tree.protected_size,
            "new_token_ratio": s.new_token_ratio,
        }

    # ---- lifecycle --------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            self._finalizer()
            if self._grammar_backend is not None:
                self._grammar_backend.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _stop(scheduler: Scheduler, runner: Runner) -> None:
    scheduler.stop()
    runner.shutdown()


def _stream_safe_len(text: str, stops: Sequence[str]) -> int:
    """How much of `text` can be streamed: hold back an incomplete character and any tail that could still
    grow into a stop string (which would then be trimmed)."""
    end = len(text)
    while end and text[end - 1] == "\ufffd":
        end -= 1
    for s in stops:
        for k in range(min(len(s) - 1, end), 0, -1):
            if text[:end].endswith(s[:k]):
                end -= k
                break
    return max(end, 0)
