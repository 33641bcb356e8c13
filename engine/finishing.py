"""Finishing requests (a mixin of Scheduler, on its thread): sampling a batch's next tokens, appending them
(grammars, jump-forward, detokenizing), the finish checks (EOS, stop ids, stop strings and regexes, length), and
ending a request: its KV to the tree, its caller told, failures kept to the request.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, cast

import torch

from sgnb.engine.meta_info import FinishReason
from sgnb.engine.request import Req, ReqStatus
from sgnb.engine.sampler import SampleOutput, sample
from sgnb.engine.stops import first_stop, has_stop, regex_window_start
from sgnb.engine.tokenizer import fit_pieces

if TYPE_CHECKING:
    from sgnb.engine.scheduler import Scheduler

log = logging.getLogger("sgnb.engine")
DETOK_CONTEXT = 6  # tokens of already-emitted text that incremental detokenization decodes again for context


class Finishing:
    """Scheduler's sampling and finishing: `_sample_and_advance` for a batch, `_finish` / `_fail` for a request."""

    _told_after: dict[int, Req] | None  # (set up by Scheduler) requests whose callers the batch tells at its end
    _follow_ups: int

    def _sample_and_advance(self: Scheduler, reqs: list[Req], hidden: Any, rows: list[int] | None) -> None:
        """Sample the next token of each request from `rows` of the forward's hidden states (all when None)."""
        t0 = self._now()
        try:
            with self.device_time.span():
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

    def _advance(self: Scheduler, reqs: list[Req], out: SampleOutput) -> None:
        """Append each request's sampled token, then finish, jump forward or tell its caller (with
        follow_up_wait_s once the batch is done: `_callers_told_after`). A request that finished meanwhile
        (aborted while its step was in flight, under overlap scheduling) is skipped."""
        with self._callers_told_after():
            self._advance_batch(reqs, out)

    def _advance_batch(self: Scheduler, reqs: list[Req], out: SampleOutput) -> None:
        now = t0 = self._now()
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
                if r.grammar_held is not None:
                    self._start_held_grammar(r)
                self._check_finish(r, token)
                if (not r.finished and r.grammar is not None and not self.config.disable_jump_forward
                        and not r.sampling.grammar_after):  # jump-forward re-reads the output from its start
                    self._jump_forward(r)
                if not r.finished:
                    self._notify(r)
            except Exception as e:
                self._fail(r, e)
        self._phase("advance", t0)

    def _sample_one_by_one(self: Scheduler, reqs: list[Req], hidden: Any, rows: list[int] | None) -> SampleOutput:
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

    def _start_held_grammar(self: Scheduler, req: Req) -> None:
        """A grammar held for the end of the reasoning starts once the output's tail holds the closing marker
        (checked each step, so the first step it completes in; the tail's last 32 tokens cover any marker)."""
        marker = req.sampling.grammar_after
        if marker and marker in self.tokenizer.decode(req.output_ids[-32:], skip_special_tokens=False):
            req.grammar, req.grammar_held = req.grammar_held, None

    def _grammar_mask(self: Scheduler, reqs: list[Req]) -> Callable[[torch.Tensor], None] | None:
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

    def _jump_forward(self: Scheduler, req: Req) -> None:
        """The grammar admits one continuation: append its canonical tokens now (re-tokenizing the last few
        generated tokens with it), to be computed by one extend next round instead of one decode each."""
        t0, cpu0 = time.perf_counter(), time.thread_time()  # nested in "advance": its clocks, not the phase mark
        try:
            self._jump_forward_one(req)
        finally:
            self.counters.phases["jump_forward"] += time.perf_counter() - t0
            self.counters.phase_cpu["jump_forward"] += time.thread_time() - cpu0

    def _jump_forward_one(self: Scheduler, req: Req) -> None:
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
            self._unread_past(req, len(req.output_ids))
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

    def _check_finish(self: Scheduler, req: Req, token: int) -> None:
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

    def _advance_text(self: Scheduler, req: Req) -> None:
        """Read the tokens not read yet into req.text and req.pieces, one at a time (incremental
        detokenization: a step costs its own tokens, not the whole output; an incomplete UTF-8 character waits
        for the token that completes it, whose piece carries it; jump-forward's tokens get a piece each)."""
        ids, skip = req.output_ids, req.sampling.skip_special_tokens
        for end in range(req.detok_read + 1, len(ids) + 1):
            base = req.detok_prefix  # the context decoded again: offsets relative to it
            new, prefix, read = self.tokenizer.decode_incremental(ids[base:end], 0, req.detok_read - base,
                                                                  skip_special_tokens=skip)
            if new:
                req.pieces += [""] * (end - 1 - len(req.pieces)) + [new]
                req.text += new
                req.detok_prefix, req.detok_read = base + prefix, base + read

    def _set_text(self: Scheduler, req: Req) -> None:
        """req.text = the exact text of the whole output (at the end, or after jump-forward rewrote tokens), with
        every token read into req.pieces and the pieces fitted to it."""
        self._advance_text(req)
        req.text = self.decode(req.output_ids, req.sampling.skip_special_tokens)
        req.pieces = fit_pieces(req.pieces, len(req.output_ids), req.text)
        req.detok_read = len(req.output_ids)
        req.detok_prefix = max(req.detok_read - DETOK_CONTEXT, 0)

    @staticmethod
    def _unread_past(req: Req, n: int) -> None:
        """Forget what reading the output past its first n tokens gave (they were rolled back)."""
        if req.detok_read > n:
            del req.pieces[n:]
            req.text = "".join(req.pieces)
            req.detok_read, req.detok_prefix = n, max(n - DETOK_CONTEXT, 0)

    def _check_stop_strings(self: Scheduler, req: Req) -> bool:
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
            found = first_stop(req.text, sp.stop, sp.stop_regex, start)
            exact = req.text if found else text
            found = found or first_stop(exact, sp.stop, sp.stop_regex, start)
            assert found is not None  # has_stop saw one in `text`
            pos, matched = found
            req.text = exact if sp.no_stop_trim else exact[:pos]
            self._finish(req, {"type": "stop", "matched": matched})
            return True
        req.stop_scan = len(text)
        return False

    def _finish(self: Scheduler, req: Req, reason: FinishReason, cache: bool = True) -> None:
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
            if self._rids.get(req.rid) is req:  # (an aborted request's rid may already name a new one)
                del self._rids[req.rid]
        c = self.counters
        if reason["type"] == "abort":
            c.requests_aborted += 1
        else:
            c.requests_finished += 1
        self.events.emit("request", {"rid": req.rid, "state": "finished",
                                     "reason": cast(str, reason["type"]),  # the engine always names one
                                     "completion_tokens": len(req.output_ids)})
        self._notify(req)

    @contextlib.contextmanager
    def _callers_told_after(self: Scheduler) -> Iterator[None]:
        """With config.follow_up_wait_s, inside the block `_notify` only notes the request and its caller is told
        at the block's end (each request once, in the order first noted; nested blocks tell at the outermost
        one's end), and the callers of ended requests are counted for `_await_follow_ups`. A caller told
        wakes its thread, which takes the GIL from this one: told one by one, the woken program threads ran
        while this thread still had the rest of the batch's tree work and bookkeeping to do (the suite's cache
        and advance phases on a GPU took 2-6x their CPU time, waiting for the GIL)."""
        if self._told_after is not None or not self.config.follow_up_wait_s:
            yield
            return
        noted: dict[int, Req] = {}
        self._told_after = noted
        try:
            yield
        finally:
            self._told_after = None
            for req in noted.values():
                self._follow_ups += req.finished
                self._notify(req)

    def _notify(self: Scheduler, req: Req) -> None:
        """Tell the request's caller (its on_update callback). A caller that has gone away (a closed event loop:
        a stopped notebook server thread; a broken queue) is detached and its request aborted, here in the
        scheduler thread: a client's failure never reaches the engine or other requests."""
        if self._told_after is not None:  # told at the end of the batch (_callers_told_after)
            self._told_after.setdefault(id(req), req)
            return
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

    def _fail(self: Scheduler, req: Req, exc: BaseException) -> None:
        log.warning("request %s failed: %r", req.rid, exc)
        req.error = exc
        self.counters.requests_failed += 1
        self._finish(req, {"type": "abort", "message": f"{type(exc).__name__}: {exc}"}, cache=False)
