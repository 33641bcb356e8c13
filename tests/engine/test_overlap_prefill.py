"""Overlapped prefill (EngineConfig.overlap_prefill, engine/prefill.py PendingPrefill): a prefill batch of newly
admitted requests is launched before the previous batch's results are read. The results must be those of the
step-by-step scheduler: the same first tokens, prompt logprobs and select scores, finish reasons and cached
tokens; aborts and a cache flush while a batch is pending lose nothing and leak no KV. On the CPU the same code
runs (forced on): the forward is synchronous there, but which batch is pending when, and the bookkeeping, are the
same. A small max_prefill_tokens splits one call's prompts over many batches, so the overlap happens for sure."""

from __future__ import annotations

import threading

import pytest
from engine_checks import assert_pool_consistent

TOL = 1e-5  # the same fp32 arithmetic either way
CONTEXT = ("Question: which of these is a fruit? The radix tree keeps the KV cache of every prompt it has seen, "
           "so a later request that shares a prefix skips recomputing it.")


@pytest.fixture(scope="module")
def engines():
    from sgnb.engine import Engine

    common = dict(quantization="none", max_prefill_tokens=96)
    on = Engine("smollm2", disable_overlap_schedule=False, overlap_prefill=True, **common)
    off = Engine("smollm2", disable_overlap_schedule=True, **common)
    yield on, off
    on.shutdown()
    off.shutdown()


def test_the_default_overlaps_prefill_only_on_cuda(engines):
    """overlap_prefill=None (the default) follows the device: on the CPU an engine with overlap scheduling forced
    on still reads each prefill batch before the next (the flag's True forces it, as the fixture's engine)."""
    from sgnb.engine import Engine

    on, off = engines
    assert on.scheduler.overlap_prefill is True
    assert off.scheduler.overlap_prefill is False  # overlap scheduling off: nothing to overlap with
    default = Engine("smollm2", disable_overlap_schedule=False, quantization="none")
    try:
        assert default.config.overlap_prefill is None
        assert default.scheduler.overlap is True
        assert default.scheduler.overlap_prefill is False  # a CPU runner: None means off
    finally:
        default.shutdown()


def _overlapped(engine) -> int:
    return engine.get_stats()["overlapped_prefills"]


def _close(a: list, b: list, tol: float = TOL) -> None:
    """(logprob, token id, ...) entries: the same tokens, logprobs within tol (None where the other has None)."""
    assert [e[1] for e in a] == [e[1] for e in b]
    assert [e[0] is None for e in a] == [e[0] is None for e in b]
    assert max((abs(x[0] - y[0]) for x, y in zip(a, b) if x[0] is not None), default=0.0) < tol


def test_first_tokens_and_prompt_logprobs_match_the_step_by_step_scheduler(engines):
    on, off = engines
    prompts = [f"{CONTEXT} Answer {i}: the" for i in range(12)]
    params = [{"max_new_tokens": n, "temperature": 0} for n in (1, 1, 2, 3, 1, 5, 1, 2, 8, 1, 1, 4)]
    on.flush_cache()
    off.flush_cache()
    before = _overlapped(on)
    a = on.generate(prompts, params, return_logprob=True, logprob_start_len=0, top_logprobs_num=2)
    b = off.generate(prompts, params, return_logprob=True, logprob_start_len=0, top_logprobs_num=2)
    assert _overlapped(on) - before >= 3  # the twelve prompts took several batches, launched back to back
    assert _overlapped(off) == 0
    for x, y in zip(a, b):
        assert x["output_ids"] == y["output_ids"]
        mx, my = x["meta_info"], y["meta_info"]
        assert mx["finish_reason"] == my["finish_reason"]
        assert mx["cached_tokens"] == my["cached_tokens"]
        _close(mx["input_token_logprobs"], my["input_token_logprobs"])
        _close(mx["output_token_logprobs"], my["output_token_logprobs"])
        for ta, tb in zip(mx["input_top_logprobs"], my["input_top_logprobs"]):
            assert [t[1] for t in ta or []] == [t[1] for t in tb or []]
    assert_pool_consistent(on)


def test_the_next_batch_shares_the_pending_batchs_prompts(engines):
    """Each prompt's own tail fills a batch, so the prompts go one batch each, every batch launched while the
    previous one is pending: each must still read the shared context from the tree, as when the scheduler
    waits for every batch's results (cached_tokens equal), and give the same tokens."""
    on, off = engines
    tail = " ".join(f"clause {j} of a long and winding tail that only this prompt has;" for j in range(6))
    prompts = [f"{CONTEXT} Case {i}: {tail} So the answer is" for i in range(5)]
    on.flush_cache()
    off.flush_cache()
    before = _overlapped(on)
    a = on.generate(prompts, {"max_new_tokens": 2, "temperature": 0})
    b = off.generate(prompts, {"max_new_tokens": 2, "temperature": 0})
    assert _overlapped(on) - before >= 2
    assert [x["meta_info"]["cached_tokens"] for x in a] == [y["meta_info"]["cached_tokens"] for y in b]
    assert min(x["meta_info"]["cached_tokens"] for x in a[1:]) > 30  # the context, from the tree
    assert [x["output_ids"] for x in a] == [y["output_ids"] for y in b]
    assert_pool_consistent(on)


def test_select_scores_from_many_threads_match(engines):
    """Selects (requests that end with their prompt) arriving from threads while batches are pending."""
    on, off = engines
    choices = [" apple", " a brick", " the moon", " banana bread"]
    prefixes = [f"{CONTEXT} Pick {i}:" for i in range(16)]
    on.flush_cache()
    off.flush_cache()
    got: dict[int, dict] = {}

    def run(i: int) -> None:
        got[i] = on.score(prefixes[i], choices)

    before = _overlapped(on)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prefixes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert _overlapped(on) > before
    for i, prefix in enumerate(prefixes):
        want = off.score(prefix, choices)
        assert got[i].keys() == want.keys()
        assert got[i]["index"] == want["index"]
        for key, value in want.items():
            if isinstance(value, float):
                assert abs(got[i][key] - value) < TOL, key
            elif isinstance(value, list) and value and isinstance(value[0], float):
                assert max(abs(x - y) for x, y in zip(got[i][key], value)) < TOL, key
    assert_pool_consistent(on)


def test_aborts_and_a_flush_while_batches_are_pending_lose_nothing(engines):
    on, off = engines
    on.flush_cache()
    prompts = [f"{CONTEXT} Item {i} is" for i in range(10)]
    rids = [f"pending-{i}" for i in range(10)]
    results: dict[str, dict] = {}

    def run(i: int) -> None:
        results[rids[i]] = on.generate(prompts[i], {"max_new_tokens": 3, "temperature": 0}, rid=rids[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(10)]
    for t in threads:
        t.start()
    for rid in rids[::3]:
        on.abort(rid)
    for t in threads:
        t.join()
    assert on.flush_cache(timeout=30)
    for i, rid in enumerate(rids):
        out = results[rid]
        if out["meta_info"]["finish_reason"]["type"] == "abort":
            assert i % 3 == 0  # only the aborted ones
            continue
        want = off.generate(prompts[i], {"max_new_tokens": 3, "temperature": 0})
        assert out["output_ids"] == want["output_ids"]
    assert_pool_consistent(on)
    # and the engine goes on serving
    assert on.generate(prompts[1], {"max_new_tokens": 2, "temperature": 0})["output_ids"] == \
        off.generate(prompts[1], {"max_new_tokens": 2, "temperature": 0})["output_ids"]



def test_a_batch_whose_logprobs_fail_at_launch_is_read_at_once(engines, monkeypatch):
    """When the batched prompt logprobs raise at launch, each request works its own out from the hidden states
    when the batch is read (such a batch is read at once, before the next forward can overwrite those states: a
    CUDA graph's output buffer), and the results are the step-by-step scheduler's."""
    on, off = engines
    sched = on.scheduler
    real = type(sched)._launch_prompt_logprobs
    raised = []

    def flaky(self, spans, hidden):
        if len(spans) > 1:  # the batched call; a request's own (one span) goes through
            raised.append(len(spans))
            raise RuntimeError("injected")
        return real(self, spans, hidden)

    monkeypatch.setattr(type(sched), "_launch_prompt_logprobs", flaky)
    prompts = [f"Short prompt number {i} says the fruit is" for i in range(40)]  # several batches
    on.flush_cache()
    off.flush_cache()
    a = on.generate(prompts, {"max_new_tokens": 1, "temperature": 0}, return_logprob=True, logprob_start_len=0)
    b = off.generate(prompts, {"max_new_tokens": 1, "temperature": 0}, return_logprob=True, logprob_start_len=0)
    assert raised  # the batched path failed, every batch of two or more
    for x, y in zip(a, b):
        assert x["output_ids"] == y["output_ids"]
        # each request's own logprobs: other matmul shapes than the batched call's, so fp32 rounding differs
        _close(x["meta_info"]["input_token_logprobs"], y["meta_info"]["input_token_logprobs"], tol=1e-4)
    assert_pool_consistent(on)
