"""In-batch sharing: prompts that arrive together and share uncached tokens compute them once, in the same round
(admission.PrefillAdder lends one request's new slots to the others). Oracle: every prompt run alone on a cold
cache (same tokens, logprobs within fp32 tolerance); the pool's accounting after every batch."""

from __future__ import annotations

import random

import pytest
from engine_checks import assert_pool_consistent

TOL = 2e-4
GREEDY = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}


def _alone(engine, ids_list, **kw):
    outs = []
    for ids in ids_list:
        engine.flush_cache()
        outs.append(engine.generate(input_ids=ids, sampling_params=GREEDY, return_logprob=True, **kw))
    engine.flush_cache()
    return outs


def _same(a: dict, b: dict) -> None:
    assert a["output_ids"] == b["output_ids"]
    la = [lp for lp, _, _ in a["meta_info"]["output_token_logprobs"]]
    lb = [lp for lp, _, _ in b["meta_info"]["output_token_logprobs"]]
    assert max(abs(x - y) for x, y in zip(la, lb)) < TOL


def _prefill(engine) -> tuple[int, int]:
    s = engine.get_stats()
    return s["prefill_batches"], s["prefill_tokens"]


def test_copies_of_a_prompt_in_one_batch_compute_it_once(engine):
    names = ["Harry", "Ron", "Hermione"]  # "Hermione" shares its first token with "Harry" only
    texts = [f"{names[i % 3]} is a character in Harry Potter. Please fill in the following information:"
             for i in range(12)]
    ids = [engine.tokenizer.encode(t) for t in texts]
    assert ids[0][0] == ids[2][0] and ids[0][1] != ids[2][1]
    engine.flush_cache()
    b0, t0 = _prefill(engine)
    outs = engine.generate(input_ids=ids, sampling_params=GREEDY, return_logprob=True)
    b1, t1 = _prefill(engine)
    assert b1 - b0 == 1  # one round: nothing waited for another request's prompt
    cached = [o["meta_info"]["cached_tokens"] for o in outs]
    # the first copy of each prompt computes it (Hermione's first token comes from Harry's), every later copy
    # only its last token (its logits)
    assert cached[:3] == [0, 0, 1]
    assert cached[3:] == [len(ids[i]) - 1 for i in range(3, 12)]
    assert t1 - t0 == len(ids[0]) + len(ids[1]) + len(ids[2]) - 1 + 9
    assert_pool_consistent(engine)
    alone = _alone(engine, ids[:3])
    for i, o in enumerate(outs):
        _same(alone[i % 3], o)


def test_only_tokens_after_the_same_prefix_are_shared(engine):
    """'Item 32' computes its '2' after its own '3' (borrowed from 'Item 3'); 'Item 12' has a '2' at the same
    position after a '1': it must not read the K/V of that '2' (computed after '3')."""
    base = "The numbered list below has many items, one per line, and this is"
    texts = [f"{base} Item {n}:" for n in (1, 3, 32, 12, 2, 22)]
    ids = [engine.tokenizer.encode(t) for t in texts]
    engine.flush_cache()
    engine.generate(input_ids=ids[0][:-4], sampling_params=GREEDY)  # the common part, cached
    outs = engine.generate(input_ids=ids, sampling_params=GREEDY, return_logprob=True)
    assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)
    assert_pool_consistent(engine)
    for a, o in zip(_alone(engine, ids), outs):
        _same(a, o)


def test_a_request_that_wants_its_prompt_logprobs_computes_its_prompt(engine, hf_logprobs):
    ids = engine.tokenizer.encode("Copies of one prompt, one of which asks for the logprobs of every prompt token.")
    engine.flush_cache()
    outs = engine.generate(input_ids=[ids, ids, ids], sampling_params=GREEDY, return_logprob=[False, True, False],
                           logprob_start_len=[-1, 0, -1])
    assert [o["meta_info"]["cached_tokens"] for o in outs] == [0, 0, len(ids) - 1]
    got = outs[1]["meta_info"]["input_token_logprobs"]
    ref = hf_logprobs(ids)
    assert len(got) == len(ids)
    assert max(abs(lp - ref[p - 1, t].item()) for p, (lp, t, _) in enumerate(got) if p) < TOL
    assert_pool_consistent(engine)


def test_a_failed_forward_frees_lenders_and_borrowers_once(engine, monkeypatch):
    ids = engine.tokenizer.encode("A prompt sent three times in one batch, and the forward fails.")
    runner = engine.runner
    original = runner.forward
    calls = {"n": 0}

    def flaky(fb):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected forward failure")
        return original(fb)

    monkeypatch.setattr(runner, "forward", flaky)
    engine.flush_cache()
    outs = engine.generate(input_ids=[ids, ids, ids], sampling_params=GREEDY)
    assert all(o["meta_info"]["finish_reason"]["type"] == "abort" for o in outs)
    assert_pool_consistent(engine)
    monkeypatch.undo()
    _same(_alone(engine, [ids])[0], engine.generate(input_ids=ids, sampling_params=GREEDY, return_logprob=True))
    assert_pool_consistent(engine)


def test_a_lender_that_fails_after_the_forward_fails_its_borrowers_alone(engine, monkeypatch):
    """The lender fails before its prompt reaches the tree: its copies cannot adopt the borrowed KV and fail
    too (cleanly: each frees only its own slots); a request with a different prompt in the batch is served."""
    ids = engine.tokenizer.encode("A lender that fails after the forward, before it caches its prompt.")
    other = engine.tokenizer.encode("An unrelated prompt in the same batch.")
    kv = engine.scheduler.kv
    original = kv.cache_unfinished
    failed = []

    def flaky(req):
        if req.origin_input_ids == ids and not failed:
            failed.append(req.rid)
            raise RuntimeError("injected caching failure")
        return original(req)

    monkeypatch.setattr(kv, "cache_unfinished", flaky)
    engine.flush_cache()
    outs = engine.generate(input_ids=[ids, other, ids, ids], sampling_params=GREEDY, return_logprob=True)
    monkeypatch.undo()
    assert len(failed) == 1
    kinds = [o["meta_info"]["finish_reason"]["type"] for o in outs]
    assert kinds == ["abort", "length", "abort", "abort"], kinds
    assert "shared failed" in outs[2]["meta_info"]["error"]
    assert_pool_consistent(engine)
    _same(_alone(engine, [other])[0], outs[1])


@pytest.mark.parametrize("seed", [0, 1])
def test_random_batches_with_shared_prefixes_match_each_prompt_alone(seed):
    """Prompts from a few shared stems, some repeated, some continuing a cached prompt, with small prefill chunks
    (chunked lenders, deferral) and a small token budget (several rounds): the same results as alone."""
    from sgnb.engine import Engine

    rng = random.Random(seed)
    with Engine("smollm2", quantization="none", chunked_prefill_size=24, max_prefill_tokens=64) as eng:
        stems = [eng.tokenizer.encode(s) for s in (
            "Once upon a time in a quiet village by the sea,", "The following is a list of facts about",
            "Once upon a time there was")]
        pool = []
        for _ in range(8):
            stem = rng.choice(stems)
            # tails from a few tokens: the same token at the same position after different ones is common
            tail = [rng.choice((1000, 1001, 1002)) for _ in range(rng.randrange(0, 30))]
            pool.append(stem[: rng.randrange(1, len(stem) + 1)] + tail)
        eng.generate(input_ids=pool[0], sampling_params=GREEDY)  # a cached prompt that others extend
        batch = [rng.choice(pool) for _ in range(16)]
        outs = eng.generate(input_ids=batch, sampling_params=GREEDY, return_logprob=True)
        assert_pool_consistent(eng)
        stats = eng.get_stats()
        assert stats["requests_failed"] == 0
        distinct = {tuple(x) for x in batch}
        alone = dict(zip(distinct, _alone(eng, [list(x) for x in distinct])))
        for ids, o in zip(batch, outs):
            _same(alone[tuple(ids)], o)
