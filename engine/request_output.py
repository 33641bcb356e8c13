"""What a request's caller gets back: its result, its stream chunks, and the waits that deliver them.

`result` is a request's SGLang-shaped output ({"text", "output_ids", "meta_info"}); read it once the request
finished (it reads a running request's fields without a lock). The waits submit requests to the engine's
scheduler and hand their results back: `wait` / `stream` block the calling thread (interruptible; an interrupt
or a closed stream aborts the requests), `wait_async` / `stream_async` run on the caller's event loop
(cancelling aborts them). The scheduler thread only flags that a request moved on; a stream reads each chunk
from the request itself (`Chunks`, one reader for both kinds of stream), so the steps that pass while its
consumer is away, or waits out the stream's interval, come as one chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from sgnb.engine.events import wait_slice
from sgnb.engine.meta_info import MetaInfo
from sgnb.engine.request import Req
from sgnb.engine.scoring import unexpanded_index
from sgnb.engine.tokenizer import fit_pieces

if TYPE_CHECKING:
    from sgnb.engine.engine import Engine

TokenText = Callable[[int], str]


def result(req: Req, text_in_logprobs: bool, token_text: TokenText) -> dict:
    """A request's output: its text, output ids and meta_info (SGLang's fields and sgnb's `output_tokens`,
    `cached_chars`, `forced_tokens`, ...). Logprob entries are (logprob, token id, its text or None)."""
    meta: MetaInfo = {
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
    # each output token's text as the scheduler detokenized it (joined: the text) and whether jump-forward
    # appended it; where the cache hit ends in a text prompt's characters: what views show
    meta["output_tokens"] = list(zip(fit_pieces(req.pieces, len(req.output_ids), req.text), req.forced))
    if req.prompt_offsets is not None:
        cached = unexpanded_index(max(req.cached_tokens, 0), [(p.offset, p.item.num_tokens) for p in req.mm])
        meta["cached_chars"] = req.prompt_offsets.prefix_chars(cached)
    if req.error is not None:
        meta["error"] = f"{type(req.error).__name__}: {req.error}"
    if req.return_logprob:
        def fmt(items: list[tuple]) -> list[tuple]:
            return fmt_logprobs(items, text_in_logprobs, token_text)

        meta["input_token_logprobs"] = fmt(req.input_token_logprobs)
        meta["output_token_logprobs"] = fmt(req.output_token_logprobs)
        if req.top_logprobs_num:
            meta["input_top_logprobs"] = [None if t is None else fmt(t) for t in req.input_top_logprobs]
            meta["output_top_logprobs"] = [None if t is None else fmt(t) for t in req.output_top_logprobs]
    return {"text": req.text, "output_ids": list(req.output_ids), "meta_info": meta}


def partial_meta(req: Req, text_in_logprobs: bool, token_text: TokenText) -> MetaInfo:
    """A stream chunk's meta_info (as SGLang's stream chunks carry it): token counts so far, and the output
    logprobs so far when asked for."""
    meta: MetaInfo = {"id": req.rid, "prompt_tokens": len(req.origin_input_ids),
                      "completion_tokens": len(req.output_ids), "cached_tokens": max(req.cached_tokens, 0)}
    if req.return_logprob:
        meta["output_token_logprobs"] = fmt_logprobs(list(req.output_token_logprobs), text_in_logprobs, token_text)
        meta["output_token_logprobs_length"] = len(meta["output_token_logprobs"])  # as SGLang's chunks
    return meta


def fmt_logprobs(items: list[tuple], with_text: bool, token_text: TokenText) -> list[tuple]:
    """(logprob, token id) pairs as (logprob, token id, the token's text, or None unless `with_text`)."""
    return [(lp, tok, token_text(tok) if with_text else None) for lp, tok in items]


def stream_safe_len(text: str, stops: Sequence[str]) -> int:
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


class Chunks:
    """One stream's reader of its request: what it has sent and when. `read` gives the next chunk; `due` says
    how long to wait before reading, so that chunks come at most every `interval` seconds. Used by the one
    thread or task that consumes the stream."""

    def __init__(self, req: Req, text_in_logprobs: bool, token_text: TokenText, interval: float) -> None:
        self.req = req
        self.text_in_logprobs = text_in_logprobs
        self.token_text = token_text
        self.interval = interval
        self.sent = 0  # characters of req.text given so far
        # time.monotonic() of the last chunk; the stream's start counts as one, so the first text comes an interval
        # in: a request shorter than its interval streams its end only (run_batch's 64 streamed programs of 0.24 s
        # each sent a first chunk at their first token, for a table that shows 0.25 s in: ~3% of the batch's time)
        self.last = time.monotonic()

    def due(self) -> float:
        """Seconds until the next chunk may come (0 without an interval)."""
        return max(self.last + self.interval - time.monotonic(), 0.0) if self.interval > 0 else 0.0

    def read(self) -> tuple[dict | None, bool]:
        """What the request wrote past the characters sent, and whether it was the last chunk. Text that may
        still turn out to begin a stop string is held back; a finished request's chunk is its whole result
        (full meta_info) with the text past those sent. None when there is nothing new yet."""
        req = self.req
        if req.finished:
            out = result(req, self.text_in_logprobs, self.token_text)
            out["text"] = req.text[self.sent:]
            self.sent = len(req.text)
            return out, True
        safe = stream_safe_len(req.text, req.sampling.stop)
        if safe <= self.sent:
            return None, False
        chunk = {"text": req.text[self.sent:safe], "meta_info": partial_meta(req, self.text_in_logprobs,
                                                                             self.token_text)}
        self.sent, self.last = safe, time.monotonic()
        return chunk, False


def wait(engine: Engine, reqs: list[Req], text_in_logprobs: bool) -> list[dict]:
    """Submit the requests and block until all finish; an interrupt aborts them."""
    # one event for the lot, set by the last to finish: the caller wakes once, not once a request (a select's
    # choices finish in the same round, and every wake-up takes the GIL from the scheduler thread)
    pending = {id(r) for r in reqs}
    done = threading.Event()

    def on_update(r: Req) -> None:  # on the scheduler thread
        if r.finished:
            pending.discard(id(r))
            if not pending:
                done.set()

    for req in reqs:
        req.on_update = on_update
    if not reqs:
        done.set()
    engine.scheduler.submit(*reqs)
    try:
        while not done.wait(wait_slice()):
            engine._check_open(workers=False)
    except BaseException:
        for req in reqs:
            engine.scheduler.abort(req.rid)
        raise
    return [result(r, text_in_logprobs, engine._token_text) for r in reqs]


def stream(engine: Engine, req: Req, text_in_logprobs: bool, interval: float) -> Iterator[dict]:
    """Submit the request and yield its chunks as it moves on (see `Chunks`); closing the stream before the
    request ends aborts it."""
    updated, finished = threading.Event(), threading.Event()

    def on_update(r: Req) -> None:  # on the scheduler thread, at every step of every streamed request
        if r.finished:
            finished.set()
            updated.set()
        elif not updated.is_set():  # a flag read; Event.set takes a lock and may wake the consumer
            updated.set()

    req.on_update = on_update
    engine.scheduler.submit(req)
    chunks = Chunks(req, text_in_logprobs, engine._token_text, interval)
    try:
        while True:
            # before each chunk (the first too: the stream's start counts as one), sleep out the interval woken
            # only by the end: a consumer waiting on `updated` meanwhile would have the scheduler thread wake it at
            # every step (py-spy --gil of a streamed 64-program run_batch: 15% of the GIL in those wake-ups
            # before, 3% after)
            if (due := chunks.due()) > 0:
                finished.wait(due)
            if not updated.wait(0.1):
                engine._check_open(workers=False)
                continue
            updated.clear()  # before reading: an update after the read flags again
            chunk, last = chunks.read()
            if chunk is not None:
                yield chunk
            if last:
                return
    finally:
        if not req.finished:
            engine.scheduler.abort(req.rid)


def set_once(fut: asyncio.Future, value: Any) -> None:
    """fut's result, unless it has one (on its loop's thread)."""
    if not fut.done():
        fut.set_result(value)


async def wait_async(engine: Engine, reqs: list[Req], text_in_logprobs: bool) -> list[dict]:
    """`wait` on the caller's event loop; cancelling aborts the requests."""
    loop = asyncio.get_running_loop()
    futures = [loop.create_future() for _ in reqs]
    for req, fut in zip(reqs, futures):
        def notify(r: Req, fut: asyncio.Future = fut) -> None:
            if r.finished:
                loop.call_soon_threadsafe(set_once, fut, r)
        req.on_update = notify
    engine.scheduler.submit(*reqs)
    try:
        done = await asyncio.gather(*futures)
    except BaseException:
        for req in reqs:
            engine.scheduler.abort(req.rid)
        raise
    return [result(r, text_in_logprobs, engine._token_text) for r in done]


async def stream_async(engine: Engine, req: Req, text_in_logprobs: bool, loop: asyncio.AbstractEventLoop,
                       interval: float) -> AsyncIterator[dict]:
    """`stream` on the event loop `loop`; cancelling or closing it before the request ends aborts it."""
    updated, finished = asyncio.Event(), asyncio.Event()
    pending = False  # a flag is queued (or set) that the consumer has not read the request since

    def flag(ended: bool) -> None:  # on the loop's thread
        updated.set()
        if ended:
            finished.set()

    def on_update(r: Req) -> None:  # on the scheduler thread: one flag queued at a time (each one queued
        nonlocal pending  # writes the loop's self-pipe)
        if r.finished:
            loop.call_soon_threadsafe(flag, True)
        elif not pending:
            pending = True
            loop.call_soon_threadsafe(flag, False)

    req.on_update = on_update
    engine.scheduler.submit(req)
    chunks = Chunks(req, text_in_logprobs, engine._token_text, interval)
    try:
        while True:
            if (due := chunks.due()) > 0:  # the interval since the last chunk (or the start), unless it ends
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(finished.wait(), due)
            await updated.wait()
            updated.clear()
            pending = False  # before reading: an update after the read queues a flag again
            chunk, last = chunks.read()
            if chunk is not None:
                yield chunk
            if last:
                return
    finally:
        if not req.finished:
            engine.scheduler.abort(req.rid)
