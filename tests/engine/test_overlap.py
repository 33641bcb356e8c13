"""Overlap scheduling (engine/scheduler.py): a decode step launched over the previous step's tokens while they are
still on the device gives the same tokens, logprobs and finish reasons as the step-by-step scheduler, with
EOS / stop strings / stop ids seen one step late, aborts and arrivals mid-decode, constrained requests beside
plain ones, and the KV pool accounted for exactly. On the CPU the same code runs (forced on): the device work is
synchronous there, but the lag, the dropped extra step and the bookkeeping are the same."""

from __future__ import annotations

import threading
import time

import pytest
from engine_checks import assert_pool_consistent

PROMPT = ("The radix tree keeps the KV cache of every prompt it has seen, so a later request that shares a "
          "prefix skips recomputing it. Here is a short story about a cat named Mo:")
TOL = 1e-5  # the same fp32 arithmetic either way


@pytest.fixture(scope="module")
def engines():
    from sgnb.engine import Engine

    on = Engine("smollm2", quantization="none", disable_overlap_schedule=False)
    off = Engine("smollm2", quantization="none", disable_overlap_schedule=True)
    yield on, off
    on.shutdown()
    off.shutdown()


def _same(a: dict, b: dict) -> None:
    assert a["output_ids"] == b["output_ids"]
    assert a["text"] == b["text"]
    ma, mb = a["meta_info"], b["meta_info"]
    assert ma["finish_reason"] == mb["finish_reason"]
    if "output_token_logprobs" in ma:
        la = [t[0] for t in ma["output_token_logprobs"]]
        lb = [t[0] for t in mb["output_token_logprobs"]]
        assert [x is None for x in la] == [y is None for y in lb]  # forced tokens have none
        assert max((abs(x - y) for x, y in zip(la, lb) if x is not None), default=0.0) < TOL
        for ta, tb in zip(ma.get("output_top_logprobs") or [], mb.get("output_top_logprobs") or []):
            assert [t[1] for t in ta or []] == [t[1] for t in tb or []]


def _both(engines, *args, **kwargs):
    on, off = engines
    on.flush_cache()
    off.flush_cache()
    before = on.scheduler.counters.overlapped_steps
    a = on.generate(*args, **kwargs)
    b = off.generate(*args, **kwargs)
    return a, b, on.scheduler.counters.overlapped_steps - before


def test_greedy_batch_with_logprobs_and_lengths(engines):
    prompts = [f"{PROMPT} Variant {i}:" for i in range(5)]
    params = [{"max_new_tokens": n, "temperature": 0} for n in (1, 2, 7, 19, 33)]
    a, b, overlapped = _both(engines, prompts, params, return_logprob=True, top_logprobs_num=3)
    assert overlapped > 10
    for x, y in zip(a, b):
        _same(x, y)
    assert [x["meta_info"]["completion_tokens"] for x in a] == [1, 2, 7, 19, 33]
    assert engines[1].scheduler.counters.overlapped_steps == 0
    assert_pool_consistent(engines[0])


def test_stops_seen_one_step_late_finish_the_same(engines):
    """EOS, stop strings (one straddling tokens) and stop ids end each request where the step-by-step
    scheduler ends it, though the overlapped scheduler has already launched the next step."""
    on, off = engines
    chat = on.apply_chat_template([{"role": "user", "content": "Say hi in three words."}])
    greedy = {"temperature": 0, "max_new_tokens": 60}
    free = off.generate(PROMPT, {**greedy, "max_new_tokens": 30})["text"]
    stop_word = free.split()[4]  # a word the story reaches after a few tokens
    cases = [(chat, greedy),  # ends on EOS
             (PROMPT, {**greedy, "stop": [stop_word]}),
             (PROMPT, {**greedy, "stop_token_ids": [off.generate(PROMPT, {**greedy, "max_new_tokens": 6})
                                                    ["output_ids"][5]]}),
             (PROMPT, {**greedy, "stop_regex": [r"\.\s"]})]
    prompts, params = [c[0] for c in cases], [c[1] for c in cases]
    a, b, overlapped = _both(engines, prompts, params, return_logprob=True)
    assert overlapped > 0
    for x, y in zip(a, b):
        _same(x, y)
    assert a[0]["meta_info"]["finish_reason"]["type"] == "stop"
    assert a[0]["meta_info"]["completion_tokens"] < 60  # EOS reached
    assert stop_word not in a[1]["text"]
    assert_pool_consistent(on)


def test_seeded_sampling_is_reproduced(engines):
    prompts = [f"{PROMPT} Take {i}:" for i in range(3)]
    params = [{"temperature": 0.9, "top_p": 0.9, "top_k": 40, "seed": 7 + i, "max_new_tokens": 16}
              for i in range(3)]
    a, b, overlapped = _both(engines, prompts, params, return_logprob=True)
    assert overlapped > 0
    for x, y in zip(a, b):
        _same(x, y)


def test_constrained_and_plain_requests_in_one_batch(engines):
    """A grammar needs the previous token on the host: the batch then steps one at a time, and both kinds of
    request still get the step-by-step results."""
    regex = r"(yes|no), because [a-z ]{5,20}\."
    prompts = [PROMPT + " Is Mo a cat? Answer:", PROMPT + " Continue:"]
    params = [{"temperature": 0, "max_new_tokens": 24, "regex": regex}, {"temperature": 0, "max_new_tokens": 24}]
    a, b, _ = _both(engines, prompts, params, return_logprob=True)
    for x, y in zip(a, b):
        _same(x, y)
    import re

    assert re.fullmatch(regex, a[0]["text"])
    assert_pool_consistent(engines[0])


def test_arrivals_and_aborts_mid_decode(engines):
    """Requests submitted while others decode, and one aborted while its step is in flight: the others get
    their solo results, the aborted one ends 'abort', no KV slot leaks or stays locked."""
    on, off = engines
    greedy = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
    want = [off.generate(f"{PROMPT} Late {i}:", greedy) for i in range(3)]
    on.flush_cache()
    results: dict[int, dict] = {}

    def late(i: int) -> None:
        time.sleep(0.05 * (i + 1))
        results[i] = on.generate(f"{PROMPT} Late {i}:", greedy)

    threads = [threading.Thread(target=late, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    stream = on.generate(PROMPT + " Abort me:", {**greedy, "max_new_tokens": 200}, stream=True, rid="ov-abort")
    for k, _chunk in enumerate(stream):
        if k == 5:
            on.abort("ov-abort")
    for t in threads:
        t.join()
    for i in range(3):
        _same(results[i], want[i])
    assert_pool_consistent(on)


def test_context_end_is_reached_the_same():
    """Requests that run into the context length finish at the same token with overlap on and off."""
    from sgnb.engine import Engine

    outs = []
    for flag in (False, True):
        with Engine("smollm2", quantization="none", context_length=96, disable_overlap_schedule=flag) as eng:
            prompt = eng.tokenizer.encode(PROMPT)[:60]
            outs.append(eng.generate(input_ids=[prompt, prompt[:50]],
                                     sampling_params={"temperature": 0, "max_new_tokens": 80, "ignore_eos": True}))
            assert_pool_consistent(eng)
    for x, y in zip(*outs):
        _same(x, y)
        assert x["meta_info"]["finish_reason"]["type"] == "length"
