"""The engine against HF transformers on the same weights, plus cache accounting, batching, aborts and faults."""

from __future__ import annotations

import threading
import time

import pytest
from engine_checks import assert_pool_consistent

TOL = 2e-4  # fp32 logprobs; different kernels and summation orders differ by ~1e-5

PROMPT = ("The radix tree keeps the KV cache of every prompt it has seen, so a later request that shares a "
          "prefix skips recomputing it. Here is a short story about a cat named Mo:")


def _ids(engine, text: str) -> list[int]:
    return engine.tokenizer.encode(text)


def test_prefill_logprobs_match_hf(engine, hf_logprobs):
    ids = _ids(engine, PROMPT)
    engine.flush_cache()
    out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1, "temperature": 0},
                          return_logprob=True, logprob_start_len=0, top_logprobs_num=3)
    ref = hf_logprobs(ids)
    got = out["meta_info"]["input_token_logprobs"]
    assert got[0][0] is None and got[0][1] == ids[0]
    assert len(got) == len(ids)
    for pos in range(1, len(ids)):
        lp, tok, _ = got[pos]
        assert tok == ids[pos]
        assert abs(lp - ref[pos - 1, tok].item()) < TOL, pos
    # top-3 at each position are HF's top-3 (ids may swap only on near-ties)
    tops = out["meta_info"]["input_top_logprobs"]
    for pos in range(1, len(ids)):
        ref_vals = ref[pos - 1].topk(3).values.tolist()
        assert [round(v, 3) for v, _, _ in tops[pos]] == pytest.approx([round(v, 3) for v in ref_vals], abs=2e-3)
    # the first sampled token's logprob is HF's at the last position
    lp, tok, _ = out["meta_info"]["output_token_logprobs"][0]
    assert abs(lp - ref[-1, tok].item()) < TOL
    assert ref[-1, tok].item() >= ref[-1].max().item() - 1e-4


def test_prompt_logprobs_of_a_batch_match_hf_row_by_row(engine, hf_logprobs):
    """One prefill of requests that each want different prompt logprobs (where they start, how many top
    entries): the batched LM-head pass gives every request its own rows, as HF computes them alone."""
    prompts = [PROMPT, PROMPT[:60], "Zebras and yaks graze.", PROMPT[::-1][:90]]
    ids = [_ids(engine, p) for p in prompts]
    starts, tops = [0, 3, -1, 5], [3, 0, 2, 5]
    engine.flush_cache()
    outs = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1, "temperature": 0},
                           return_logprob=True, logprob_start_len=starts, top_logprobs_num=tops)
    for seq, start, k, out in zip(ids, starts, tops, outs):
        ref = hf_logprobs(seq)
        got, top = out["meta_info"]["input_token_logprobs"], out["meta_info"].get("input_top_logprobs")
        first = start if start >= 0 else len(seq)  # -1: no prompt logprobs
        assert [t for _, t, _ in got] == seq[first:]
        for j, (lp, tok, _) in enumerate(got):
            pos = first + j
            if pos == 0:
                assert lp is None and (not k or top[j] is None)
                continue
            assert abs(lp - ref[pos - 1, tok].item()) < TOL, (pos, start)
            if k:
                assert [round(v, 3) for v, _, _ in top[j]] == pytest.approx(
                    [round(v, 3) for v in ref[pos - 1].topk(k).values.tolist()], abs=2e-3)
            else:
                assert top is None  # none asked for: the key is left out


def test_decode_on_cached_prefix_matches_hf(engine, hf_logprobs):
    """Greedy decode over a prefix served from the radix cache gives HF's logprobs at every step."""
    ids = _ids(engine, PROMPT)
    engine.flush_cache()
    engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 0})  # cache the prompt
    longer = ids + _ids(engine, " Mo liked")
    out = engine.generate(input_ids=longer, sampling_params={"max_new_tokens": 16, "temperature": 0,
                                                              "ignore_eos": True},
                          return_logprob=True, top_logprobs_num=2)
    assert out["meta_info"]["cached_tokens"] == len(ids)
    gen = [t for _, t, _ in out["meta_info"]["output_token_logprobs"]]
    assert gen == out["output_ids"] and len(gen) == 16
    ref = hf_logprobs(longer + gen)
    for step, (lp, tok, _) in enumerate(out["meta_info"]["output_token_logprobs"]):
        row = ref[len(longer) - 1 + step]
        assert abs(lp - row[tok].item()) < TOL, step
        top2 = row.topk(2).values
        # greedy picked HF's argmax unless the two best are within tolerance of each other
        assert row[tok].item() >= top2[0].item() - TOL, step


def test_cached_kv_equals_recompute(engine):
    """Logprobs of a continuation are the same whether its prefix KV came from the cache or was recomputed."""
    ids = _ids(engine, PROMPT + " Mo was a curious cat who")
    engine.flush_cache()
    cold = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 8, "temperature": 0},
                           return_logprob=True)
    assert cold["meta_info"]["cached_tokens"] == 0
    warm = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 8, "temperature": 0},
                           return_logprob=True)
    assert warm["meta_info"]["cached_tokens"] == len(ids) - 1  # the last token is recomputed for its logits
    a = [lp for lp, _, _ in cold["meta_info"]["output_token_logprobs"]]
    b = [lp for lp, _, _ in warm["meta_info"]["output_token_logprobs"]]
    assert cold["output_ids"] == warm["output_ids"]
    assert max(abs(x - y) for x, y in zip(a, b)) < TOL


def test_chunked_prefill_matches_hf(hf_logprobs):
    from sgnb.engine import Engine

    with Engine("smollm2", chunked_prefill_size=7, max_prefill_tokens=16, quantization="none") as eng:
        ids = _ids(eng, PROMPT)
        out = eng.generate(input_ids=ids, sampling_params={"max_new_tokens": 4, "temperature": 0},
                           return_logprob=True, logprob_start_len=0)
        ref = hf_logprobs(ids)
        got = out["meta_info"]["input_token_logprobs"]
        assert len(got) == len(ids)
        assert max(abs(lp - ref[p - 1, t].item()) for p, (lp, t, _) in enumerate(got) if p) < TOL
        assert_pool_consistent(eng)


def test_exact_cached_tokens_accounting(engine):
    engine.flush_cache()
    a = list(range(1000, 1050))
    b = a + list(range(2000, 2020))
    c = a[:30] + list(range(3000, 3010))
    sp = {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}
    assert engine.generate(input_ids=a, sampling_params=sp)["meta_info"]["cached_tokens"] == 0
    assert engine.generate(input_ids=b, sampling_params=sp)["meta_info"]["cached_tokens"] == 50
    assert engine.generate(input_ids=c, sampling_params=sp)["meta_info"]["cached_tokens"] == 30  # splits a node
    assert engine.generate(input_ids=b, sampling_params=sp)["meta_info"]["cached_tokens"] == 69
    # generated tokens are cached too: prompt + output of the earlier request is a prefix now
    out = engine.generate(input_ids=a, sampling_params=sp)
    again = engine.generate(input_ids=a + out["output_ids"][:1] + [5], sampling_params=sp)
    assert again["meta_info"]["cached_tokens"] == 51
    assert_pool_consistent(engine)


def test_output_tokens_and_cached_chars(engine):
    """meta_info's output_tokens: each output token's text as the scheduler detokenized it (a character split over
    tokens is carried by the one that completes it; tokens past a trimmed stop string or EOS read "") with
    whether jump-forward forced it; they join to the text. cached_chars: where the cache hit ends in a text
    prompt's characters (none for input_ids)."""
    prompt = f"<|im_start|>user\nSay hi {time.time_ns()}.<|im_end|>\n<|im_start|>assistant\n"
    cases = [{"max_new_tokens": 16}, {"max_new_tokens": 16, "stop": [" "]}, {"max_new_tokens": 200},
             {"max_new_tokens": 16, "regex": "(日本語|naïve) [a-z]{2,8}!"}]
    for params in cases:
        out = engine.generate(prompt, {"temperature": 0, **params})
        meta, text = out["meta_info"], out["text"]
        pairs = meta["output_tokens"]
        assert len(pairs) == len(out["output_ids"]) and "".join(t for t, _ in pairs) == text, (params, pairs)
        assert [f for _, f in pairs] == meta.get("output_forced", [False] * len(pairs))
        assert meta["cached_chars"] == len(engine.tokenizer.decode(
            engine.tokenizer.encode(prompt)[:meta["cached_tokens"]], skip_special_tokens=False))
    assert any(f for _, f in pairs) and "\ufffd" not in "".join(t for t, _ in pairs)  # the regex gen's
    longer = engine.generate(prompt + "Hi", {"max_new_tokens": 1, "temperature": 0})["meta_info"]
    assert longer["cached_tokens"] > 0 and longer["cached_chars"] == len(prompt)
    assert "cached_chars" not in engine.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 1})[
        "meta_info"]


def _greedy(engine, prompts, n=12, **kw):
    outs = engine.generate(prompts, {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
                           return_logprob=True, top_logprobs_num=2, **kw)
    return outs


def _same_or_near_tie(a: dict, b: dict) -> None:
    """Token sequences equal, or they first differ where the top-2 logit margin is below 1e-4."""
    for i, (x, y) in enumerate(zip(a["output_ids"], b["output_ids"])):
        if x != y:
            top = a["meta_info"]["output_top_logprobs"][i]
            assert abs(top[0][0] - top[1][0]) < 1e-4, f"diverged at {i} with margin {top[0][0] - top[1][0]}"
            return


def test_batch_invariance(engine):
    target = PROMPT + " One morning"
    others = [f"Question {i}: what is {i} plus {i * 3}? Answer:" for i in range(7)] + ["Hi", PROMPT * 2]
    engine.flush_cache()
    alone = _greedy(engine, [target])[0]
    engine.flush_cache()
    mixed = _greedy(engine, others[:4] + [target] + others[4:])[4]
    _same_or_near_tie(alone, mixed)
    lps_a = [lp for lp, _, _ in alone["meta_info"]["output_token_logprobs"]]
    lps_m = [lp for lp, _, _ in mixed["meta_info"]["output_token_logprobs"]]
    if alone["output_ids"] == mixed["output_ids"]:
        assert max(abs(x - y) for x, y in zip(lps_a, lps_m)) < TOL


def test_scheduling_policies_and_no_radix_agree(engine):
    from sgnb.engine import Engine

    prompts = [PROMPT + f" Chapter {i}." for i in range(5)] + ["Unrelated: the sea is"]
    engine.flush_cache()
    base = _greedy(engine, prompts, n=6)
    for kw in ({"schedule_policy": "fcfs"}, {"schedule_policy": "dfs-weight"}, {"disable_radix_cache": True}):
        with Engine("smollm2", quantization="none", **kw) as eng:
            outs = _greedy(eng, prompts, n=6)
            for a, b in zip(base, outs):
                _same_or_near_tie(a, b)
            if kw.get("disable_radix_cache"):
                assert all(o["meta_info"]["cached_tokens"] == 0 for o in outs)
                assert eng.tree.total_size == 0
            else:
                assert sum(o["meta_info"]["cached_tokens"] for o in outs) > 4 * 30
            assert_pool_consistent(eng)


def test_64_concurrent_threads(engine):
    engine.flush_cache()
    results: dict[int, dict] = {}
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            results[i] = engine.generate(f"{PROMPT} Item {i}:", {"max_new_tokens": 1 + i % 8, "temperature": 0.7,
                                                                 "seed": i, "ignore_eos": True})
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors and len(results) == 64
    for i, r in results.items():
        assert r["meta_info"]["completion_tokens"] == 1 + i % 8
        assert r["meta_info"]["finish_reason"]["type"] == "length"
    # the shared prompt was computed once and then served from the cache
    assert sum(r["meta_info"]["cached_tokens"] for r in results.values()) >= 50 * len(_ids(engine, PROMPT)) * 0.9
    # seeded sampling is reproducible
    again = engine.generate(f"{PROMPT} Item 5:", {"max_new_tokens": 6, "temperature": 0.7, "seed": 5,
                                                  "ignore_eos": True})
    assert again["output_ids"] == results[5]["output_ids"]
    assert_pool_consistent(engine)


def test_abort_frees_locks_and_slots(engine):
    engine.flush_cache()
    stream = engine.generate(PROMPT, {"max_new_tokens": 500, "ignore_eos": True, "temperature": 0}, stream=True)
    chunks = []
    for chunk in stream:
        chunks.append(chunk)
        if len(chunks) == 3:
            break
    stream.close()  # closing the stream aborts the request
    assert_pool_consistent(engine)
    assert engine.get_stats()["requests_aborted"] >= 1

    # abort by id while queued behind a long request, and while running
    rid = "abort-me"
    done = threading.Event()
    box = {}

    def run() -> None:
        box["out"] = engine.generate(PROMPT, {"max_new_tokens": 400, "ignore_eos": True}, rid=rid)
        done.set()

    t = threading.Thread(target=run)
    t.start()
    time.sleep(0.5)
    engine.abort(rid)
    assert done.wait(30)
    assert box["out"]["meta_info"]["finish_reason"]["type"] == "abort"
    assert box["out"]["meta_info"]["completion_tokens"] < 400
    assert_pool_consistent(engine)
    # the engine is still fine
    assert engine.generate("Hello", {"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2


def test_kv_exhaustion_retracts_and_finishes():
    """A pool far smaller than the work: requests queue and get retracted, all finish with the same tokens."""
    from sgnb.engine import Engine

    prompts = [f"{PROMPT} Variant {i}:" for i in range(6)]
    with Engine("smollm2", quantization="none") as big:
        want = _greedy(big, prompts, n=40)
    with Engine("smollm2", max_total_tokens=200, init_new_token_ratio=0.0, min_new_token_ratio=0.0, quantization="none") as small:
        got = _greedy(small, prompts, n=40)
        assert small.get_stats()["retractions"] > 0
        for a, b in zip(want, got):
            assert b["meta_info"]["completion_tokens"] == 40
            _same_or_near_tie(a, b)
        assert_pool_consistent(small)


def test_prompt_larger_than_pool_is_rejected():
    from sgnb.engine import Engine

    with Engine("smollm2", max_total_tokens=64, quantization="none") as eng:
        with pytest.raises(ValueError, match="at most 63"):
            eng.generate(PROMPT * 3, {"max_new_tokens": 1})
        # a prompt that fits, with more new tokens than the pool could ever hold: refused up front, not midway
        with pytest.raises(ValueError, match="cannot fit this engine's KV pool of 64 tokens"):
            eng.generate("Hi", {"max_new_tokens": 100, "ignore_eos": True})
        assert eng.generate("Hi", {"max_new_tokens": 3, "ignore_eos": True})["meta_info"]["completion_tokens"] == 3


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"prompt": ""}, ValueError, "empty"),
        ({"prompt": "x " * 9000}, ValueError, "context length"),
        ({"sampling_params": {"temperature": -1}}, ValueError, "temperature"),
        ({"sampling_params": {"top_p": 0}}, ValueError, "top_p"),
        ({"sampling_params": {"top_p": 1.5}}, ValueError, "top_p"),
        ({"sampling_params": {"stop_regex": "(unclosed"}}, ValueError, "stop_regex"),
        ({"sampling_params": {"max_tokens": 3}}, TypeError, "max_tokens"),
        ({"prompt": None, "input_ids": [1, 2, 10**9]}, ValueError, "vocabulary"),
        ({"prompt": None, "input_ids": [1, 2.5, 3]}, ValueError, "input_ids must be a list of ints"),
        ({"prompt": None, "input_ids": [1, True]}, ValueError, "input_ids must be a list of ints"),
        # far too long: refused by its length in characters, before the tokenizer reads it
        ({"prompt": "x" * 3_000_000}, ValueError, "3000000 characters"),
        ({"return_logprob": True, "logprob_start_len": 999}, ValueError, "logprob_start_len"),
        # strict types: a mistake is reported with the field's name, never coerced
        ({"sampling_params": {"max_new_tokens": 2.5}}, ValueError, "max_new_tokens=2.5: must be an int"),
        ({"sampling_params": {"max_new_tokens": True}}, ValueError, "max_new_tokens"),
        ({"sampling_params": {"top_k": 1.5}}, ValueError, "top_k"),
        ({"sampling_params": {"seed": 1.5}}, ValueError, "seed"),
        ({"sampling_params": {"ignore_eos": "yes"}}, ValueError, "ignore_eos='yes': must be true or false"),
        ({"sampling_params": {"temperature": float("inf")}}, ValueError, "temperature"),
        ({"sampling_params": {"temperature": "0.5"}}, ValueError, "temperature='0.5': must be a finite number"),
        ({"sampling_params": {"stop_token_ids": ["5"]}}, ValueError, "stop_token_ids"),
        ({"sampling_params": {"stop": 5}}, ValueError, "stop"),
        ({"return_logprob": True, "logprob_start_len": 1.5}, ValueError, "logprob_start_len"),
        # values the sampler cannot serve for this model: once, they raised inside a batch and aborted its others
        ({"sampling_params": {"stop_token_ids": [10**6], "min_new_tokens": 2}}, ValueError, "vocabulary"),
        ({"return_logprob": True, "top_logprobs_num": 10**6}, ValueError, "top_logprobs_num"),
    ],
)
def test_bad_input_is_rejected_before_model_work(engine, kwargs, exc, match):
    before = engine.get_stats()
    call = {"prompt": "Hello", **kwargs}
    with pytest.raises(exc, match=match):
        engine.generate(**call)
    after = engine.get_stats()
    assert after["prompt_tokens"] == before["prompt_tokens"]  # nothing reached the scheduler
    assert engine.generate("Hello", {"max_new_tokens": 1})["meta_info"]["completion_tokens"] == 1


def test_failure_inside_engine_fails_only_that_request(engine, monkeypatch):
    sched = engine.scheduler
    original = sched._check_finish

    def faulty(req, token):
        if req.rid.startswith("poison"):
            raise RuntimeError("injected fault")
        return original(req, token)

    monkeypatch.setattr(sched, "_check_finish", faulty)
    outs = engine.generate([PROMPT, PROMPT + " B", PROMPT + " C"], {"max_new_tokens": 5, "ignore_eos": True},
                           rid=["ok-1", "poison-1", "ok-2"])
    assert outs[1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert "injected fault" in outs[1]["meta_info"]["error"]
    assert [o["meta_info"]["completion_tokens"] for o in (outs[0], outs[2])] == [5, 5]
    monkeypatch.undo()
    assert_pool_consistent(engine)


def test_a_failure_in_sampling_fails_only_its_request(engine, monkeypatch):
    """A batch whose sampling raises (something validation did not foresee, injected here for one request) is
    sampled again request by request: only that request fails; the others decode exactly as they would alone."""
    import sgnb.engine.finishing as scheduler_module  # where the scheduler samples

    prompts = [PROMPT, PROMPT + " B", PROMPT + " C"]
    sp = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    alone = [engine.generate(p, sp)["output_ids"] for p in prompts]
    original = scheduler_module.sample

    def faulty(logits, reqs, *args, **kwargs):
        if any(r.rid.startswith("poison") for r in reqs):
            raise IndexError("injected sampling fault")
        return original(logits, reqs, *args, **kwargs)

    monkeypatch.setattr(scheduler_module, "sample", faulty)
    outs = engine.generate(prompts, sp, rid=["ok-1", "poison-1", "ok-2"])
    monkeypatch.undo()
    assert outs[1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert "injected sampling fault" in outs[1]["meta_info"]["error"]
    assert [outs[0]["output_ids"], outs[2]["output_ids"]] == [alone[0], alone[2]]
    assert_pool_consistent(engine)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # closing the orphan, below
def test_a_caller_whose_event_loop_closed_does_not_kill_the_engine(engine):
    """A notebook's server thread stops (its event loop closes) with a stream in flight: the scheduler's next
    callback hits the closed loop; the request is aborted and detached, the engine keeps serving."""
    import asyncio
    import threading

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def consume() -> None:
        stream = await engine.async_generate(PROMPT, {"max_new_tokens": 400, "ignore_eos": True}, stream=True,
                                             rid="orphan")
        async for _ in stream:
            pass

    tasks = []
    loop.call_soon_threadsafe(lambda: tasks.append(loop.create_task(consume())))
    deadline = time.time() + 20
    while engine.get_stats()["running"] == 0 and time.time() < deadline:
        time.sleep(0.01)
    assert engine.get_stats()["running"] == 1
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()  # what a stopped server thread leaves behind
    while engine.scheduler.busy and time.time() < deadline:
        time.sleep(0.01)
    assert not engine.scheduler.busy, "the orphaned request should have been aborted"
    assert engine.scheduler.fatal is None
    assert engine.generate("Hi", {"max_new_tokens": 3, "ignore_eos": True})["meta_info"]["completion_tokens"] == 3
    assert_pool_consistent(engine)
    try:  # end the orphaned coroutine now rather than in the garbage collector
        tasks[0].get_coro().close()
    except RuntimeError:
        pass  # its cleanup needs the loop that is gone


def test_a_rid_names_one_request_in_flight(engine):
    """A second request with a rid in use is refused (aborting by rid must not hit another client's request);
    the rid is free again once its request finishes."""
    import threading

    box: dict = {}
    t = threading.Thread(target=lambda: box.update(out=engine.generate(
        PROMPT, {"max_new_tokens": 400, "ignore_eos": True}, rid="dup")))
    t.start()
    deadline = time.time() + 20
    while engine.get_stats()["running"] == 0 and time.time() < deadline:
        time.sleep(0.01)
    with pytest.raises(ValueError, match="rid 'dup' is already in use"):
        engine.generate("Hi", {"max_new_tokens": 2}, rid="dup")
    with pytest.raises(ValueError, match="rid 'twin' is already in use"):
        engine.generate(["Hi", "Ho"], {"max_new_tokens": 2}, rid=["twin", "twin"])
    engine.abort("dup")
    t.join(30)
    assert box["out"]["meta_info"]["finish_reason"]["type"] == "abort"  # the first one, aborted by its owner
    assert engine.generate("Hi", {"max_new_tokens": 2, "ignore_eos": True}, rid="dup")["meta_info"]["id"] == "dup"
    assert engine.generate("Hi", {"max_new_tokens": 2, "ignore_eos": True}, rid="twin")["meta_info"]["id"] == "twin"
    assert_pool_consistent(engine)


def test_stop_conditions(engine):
    out = engine.generate("Count: 1, 2, 3, 4, 5, 6,", {"max_new_tokens": 30, "temperature": 0, "stop": [" 9"]})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": " 9"}
    assert " 9" not in out["text"] and out["text"].strip().startswith("7")
    out = engine.generate("Count: 1, 2, 3, 4, 5, 6,", {"max_new_tokens": 30, "temperature": 0,
                                                      "stop_regex": r"\b8\b"})
    assert out["meta_info"]["finish_reason"]["matched"] == "8"
    tok = engine.tokenizer.encode(" 7")[0]
    out = engine.generate("Count: 1, 2, 3, 4, 5, 6,", {"max_new_tokens": 30, "temperature": 0,
                                                      "stop_token_ids": [tok]})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": tok}
    out = engine.generate("Hi", {"max_new_tokens": 7, "min_new_tokens": 7, "temperature": 0})
    assert out["meta_info"]["completion_tokens"] == 7


def test_streaming_concatenates_to_full_text(engine):
    sp = {"max_new_tokens": 40, "temperature": 0, "stop": [" the end", "."]}
    full = engine.generate(PROMPT + "\nOnce upon a time", sp)
    pieces = [c["text"] for c in engine.generate(PROMPT + "\nOnce upon a time", sp, stream=True)]
    assert "".join(pieces) == full["text"] and len(pieces) > 2



def test_stream_interval_coalesces_steps_and_ends_at_once(engine):
    """stream_interval_s: chunks come at most that often, the first one interval after the call, each carrying
    the steps between, the same text in all; the request's end is never held back for the interval."""
    import time

    sp = {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True}
    full = engine.generate(PROMPT, sp)
    pieces = []
    t0 = time.monotonic()
    for chunk in engine.generate(PROMPT, sp, stream=True, stream_interval_s=0.15):
        pieces.append(chunk["text"])
    elapsed = time.monotonic() - t0
    assert "".join(pieces) == full["text"]
    # the chunks before the last came >= 0.15 s apart, whatever delays the consumer itself saw (a loaded machine);
    # so where the 48 steps took less than 48 intervals, steps travelled together (no count of chunks is asserted
    # apart from this: on a machine loaded enough for a step to take 0.15 s, every step is a chunk of its own)
    assert (len(pieces) - 1) * 0.15 <= elapsed, (len(pieces), elapsed)
    t0 = time.monotonic()
    chunks = list(engine.generate(PROMPT, {**sp, "max_new_tokens": 4}, stream=True, stream_interval_s=60))
    assert time.monotonic() - t0 < 30 and chunks[-1]["meta_info"]["completion_tokens"] == 4
    assert len(chunks) == 1  # shorter than its interval: its end only


def test_async_stream_interval_coalesces_steps_and_ends_at_once(engine):
    """async_generate's stream_interval_s as generate's (the one chunk reader both streams share): chunks at most
    that often, the same text in all, the request's end never held back."""
    import asyncio

    sp = {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True}
    full = engine.generate(PROMPT, sp)

    async def read(params: dict, interval: float) -> tuple[list[dict], float]:
        t0 = time.monotonic()
        stream = await engine.async_generate(PROMPT, params, stream=True, stream_interval_s=interval)
        return [c async for c in stream], time.monotonic() - t0

    chunks, elapsed = asyncio.run(read(sp, 0.15))
    assert "".join(c["text"] for c in chunks) == full["text"]
    assert (len(chunks) - 1) * 0.15 <= elapsed, (len(chunks), elapsed)  # as in the test above
    chunks, elapsed = asyncio.run(read({**sp, "max_new_tokens": 4}, 60))
    assert elapsed < 30 and chunks[-1]["meta_info"]["completion_tokens"] == 4 and len(chunks) == 1


def test_async_generate(engine):
    import asyncio

    async def main():
        outs = await asyncio.gather(*(engine.async_generate(f"{PROMPT} {i}", {"max_new_tokens": 3,
                                                                              "ignore_eos": True})
                                      for i in range(4)))
        chunks = [c async for c in await engine.async_generate(PROMPT, {"max_new_tokens": 5, "ignore_eos": True},
                                                               stream=True)]
        return outs, chunks

    outs, chunks = asyncio.run(main())
    assert [o["meta_info"]["completion_tokens"] for o in outs] == [3, 3, 3, 3]
    assert chunks[-1]["meta_info"]["completion_tokens"] == 5


def test_n_samples_and_sampling_params(engine):
    outs = engine.generate(PROMPT, {"max_new_tokens": 5, "temperature": 1.0, "top_k": 20, "top_p": 0.9,
                                    "min_p": 0.05, "n": 3, "seed": 7, "ignore_eos": True})
    assert len(outs) == 3 and all(o["meta_info"]["completion_tokens"] == 5 for o in outs)
    again = engine.generate(PROMPT, {"max_new_tokens": 5, "temperature": 1.0, "top_k": 20, "top_p": 0.9,
                                     "min_p": 0.05, "n": 3, "seed": 7, "ignore_eos": True})
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in again]
    # top_k=1 is greedy whatever the temperature
    g = engine.generate(PROMPT, {"max_new_tokens": 5, "temperature": 0})["output_ids"]
    k1 = engine.generate(PROMPT, {"max_new_tokens": 5, "temperature": 1.5, "top_k": 1})["output_ids"]
    assert g == k1
    # a strong repetition penalty changes a repetitive greedy continuation
    rep = engine.generate("a a a a a a a a", {"max_new_tokens": 6, "temperature": 0})["output_ids"]
    pen = engine.generate("a a a a a a a a", {"max_new_tokens": 6, "temperature": 0,
                                              "repetition_penalty": 2.0})["output_ids"]
    assert rep != pen


@pytest.mark.parametrize("method", ["token_length_normalized", "greedy_token_selection",
                                    "unconditional_likelihood_normalized"])
def test_choice_scoring_matches_hf(engine, hf_logprobs, method):
    prefix = "Q: What color is a ripe banana?\nA:"
    choices = [" yellow", " dark purple with spots", " blue"]
    res = engine.score(prefix, choices, method)
    for i, c in enumerate(choices):
        full = engine.tokenizer.encode(prefix + c)
        ref = hf_logprobs(full)
        got = res["input_token_logprobs"][i]
        n = len(got)
        want = [ref[p - 1, full[p]].item() for p in range(len(full) - n, len(full))]
        assert got[0][0] is None  # SGLang's entries: the first (the token at logprob_start_len) has no logprob
        assert max(abs(a[0] - b) for a, b in zip(got[1:], want[1:])) < TOL
    assert res["choice"] == choices[res["index"]]
    if method == "token_length_normalized":  # SGLang's mean: every entry with a logprob
        means = [sum(lp for lp, _, _ in row[1:]) / len(row[1:]) for row in res["input_token_logprobs"]]
        assert res["normalized_prompt_logprobs"] == pytest.approx(means)
        assert res["index"] == max(range(3), key=lambda i: means[i])


def test_failed_forward_fails_its_batch_and_frees_its_kv(engine, monkeypatch):
    """A model error (e.g. a bad kernel launch) fails the requests of that batch; their freshly allocated KV
    slots are released and the engine serves the next request."""
    runner = engine.runner
    original = runner.forward
    calls = {"n": 0}

    def flaky(fb):
        calls["n"] += 1
        if calls["n"] in (1, 3):  # the first prefill, then a decode step of the second request
            raise RuntimeError("injected forward failure")
        return original(fb)

    monkeypatch.setattr(runner, "forward", flaky)
    engine.flush_cache()
    out = engine.generate(PROMPT, {"max_new_tokens": 4, "ignore_eos": True})
    assert out["meta_info"]["finish_reason"]["type"] == "abort" and "injected" in out["meta_info"]["error"]
    out = engine.generate(PROMPT + " again", {"max_new_tokens": 4, "ignore_eos": True})
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert_pool_consistent(engine)
    monkeypatch.undo()
    assert engine.generate(PROMPT, {"max_new_tokens": 3, "ignore_eos": True})["meta_info"]["completion_tokens"] == 3
    assert_pool_consistent(engine)


def test_text_ids_outside_the_vocabulary_are_refused(tmp_path):
    """A tokenizer larger than the model's vocabulary (a dummy model with SmolLM2's tokenizer) is caught at the
    generate() call with a clear error, not as a device-side assert in the embedding."""
    import json

    from sgnb.engine import Engine
    from sgnb.engine.model_loader import CONFIGS_DIR

    cfg = json.loads((CONFIGS_DIR / "tiny.json").read_text())
    cfg["vocab_size"] = 1000  # the SmolLM2 tokenizer has 49,152 ids
    path = tmp_path / "small-vocab.json"
    path.write_text(json.dumps(cfg))
    eng = Engine(f"dummy:{path}", device="cpu", max_total_tokens=256)
    try:
        with pytest.raises(ValueError, match="outside the model's vocabulary"):
            eng.generate("The capital of France is Paris", {"max_new_tokens": 2})
        with pytest.raises(ValueError, match="outside the vocabulary"):
            eng.generate(input_ids=[5, 1000], sampling_params={"max_new_tokens": 2})
        out = eng.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2, "ignore_eos": True})
        assert len(out["output_ids"]) == 2 and all(0 <= t < 1000 for t in out["output_ids"])
    finally:
        eng.shutdown()


def test_incremental_text_and_stop_strings_equal_full_decoding(engine):
    """The output text is built incrementally (each step decodes its own tokens): it equals decoding the whole
    output, a stop string that straddles tokens is found and trimmed, and one that appeared before
    min_new_tokens still stops the request once min_new_tokens is reached (trimmed at its first occurrence)."""
    ids = _ids(engine, PROMPT)
    base = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}
    full = engine.generate(input_ids=ids, sampling_params=base)
    assert full["text"] == engine.tokenizer.decode(full["output_ids"])
    text = full["text"]
    pieces = [engine.tokenizer.decode(full["output_ids"][:k]) for k in range(1, 41)]
    # a stop string across the boundary of the 10th and 11th tokens
    cut = len(pieces[9])
    stop = text[cut - 2: cut + 2]
    assert len(stop) == 4 and text.find(stop) >= 0
    out = engine.generate(input_ids=ids, sampling_params={**base, "stop": [stop]})
    assert out["text"] == text[: text.find(stop)] and out["meta_info"]["finish_reason"]["matched"] == stop
    # an early stop string with min_new_tokens past it: finishes at min_new_tokens, trimmed at the first hit
    early = text[len(pieces[1]): len(pieces[2])]
    out = engine.generate(input_ids=ids, sampling_params={**base, "stop": [early], "min_new_tokens": 12})
    assert len(out["output_ids"]) == 12 and out["text"] == text[: text.find(early)]


def test_decode_over_contiguous_slots_reads_the_pool_in_place(engine, hf_logprobs):
    """The torch backend's decode route: a lone request's slots form one long contiguous run (read as a view)
    plus a gathered rest; with several requests the runs interleave and it takes the reference path. Either way
    every step's logprob equals HF's."""
    ids = _ids(engine, PROMPT) * 2  # > MIN_VIEW_RUN tokens
    engine.flush_cache()
    out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
                          return_logprob=True)
    ref = hf_logprobs(ids + out["output_ids"])
    for step, (lp, tok, _) in enumerate(out["meta_info"]["output_token_logprobs"]):
        assert abs(lp - ref[len(ids) - 1 + step, tok].item()) < TOL, step
    outs = engine.generate(input_ids=[ids, ids[:-3]], sampling_params={"max_new_tokens": 6, "temperature": 0,
                                                                      "ignore_eos": True}, return_logprob=True)
    for prompt, o in zip([ids, ids[:-3]], outs):
        ref = hf_logprobs(prompt + o["output_ids"])
        for step, (lp, tok, _) in enumerate(o["meta_info"]["output_token_logprobs"]):
            assert abs(lp - ref[len(prompt) - 1 + step, tok].item()) < TOL, step


def test_batch_with_two_shared_prefixes_reads_each_once(engine, hf_logprobs):
    """Requests over two different cached few-shot prefixes, decoded in one batch: the scheduler groups them by
    prefix (each group's prefix attended once, a cascade per group) and every logprob still equals HF's."""
    engine.flush_cache()
    a = _ids(engine, PROMPT)
    b = _ids(engine, "A different few-shot block, about the weather and the sea, long enough to share. " * 3)
    assert len(a) >= 32 and len(b) >= 32
    engine.generate(input_ids=[a, b], sampling_params={"max_new_tokens": 0})  # cache both prefixes
    prompts = [a + _ids(engine, " Question one?"), b + _ids(engine, " Question two?"),
               a + _ids(engine, " Question three?"), b + _ids(engine, " Question four?")]
    before = engine.get_stats()["cascade_batches"]
    outs = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 5, "temperature": 0,
                                                               "ignore_eos": True}, return_logprob=True)
    assert engine.get_stats()["cascade_batches"] > before
    for prompt, o in zip(prompts, outs):
        ref = hf_logprobs(prompt + o["output_ids"])
        for step, (lp, tok, _) in enumerate(o["meta_info"]["output_token_logprobs"]):
            assert abs(lp - ref[len(prompt) - 1 + step, tok].item()) < TOL, step


def test_running_requests_ride_along_with_a_prefill(engine, hf_logprobs):
    """A request admitted while others decode shares their forward (a mixed batch): the decoding ones advance
    in the prefill round instead of waiting for it, and every logprob still equals HF's."""
    import threading

    engine.flush_cache()
    first = _ids(engine, PROMPT)
    late = _ids(engine, "A second, unrelated prompt arrives while the first one decodes its answer.")
    sp = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    outs: dict[str, dict] = {}
    before, generated = engine.get_stats()["mixed_batches"], engine.get_stats()["generated_tokens"]
    t = threading.Thread(target=lambda: outs.update(a=engine.generate(input_ids=first, sampling_params=sp,
                                                                        return_logprob=True)))
    t.start()
    deadline = time.time() + 30
    while engine.get_stats()["generated_tokens"] < generated + 3 and time.time() < deadline:
        time.sleep(0.005)
    outs["b"] = engine.generate(input_ids=late, sampling_params={**sp, "max_new_tokens": 4}, return_logprob=True)
    t.join()
    assert engine.get_stats()["mixed_batches"] > before  # the first request decoded in the second's prefill
    for prompt, o in ((first, outs["a"]), (late, outs["b"])):
        ref = hf_logprobs(prompt + o["output_ids"])
        for step, (lp, tok, _) in enumerate(o["meta_info"]["output_token_logprobs"]):
            assert abs(lp - ref[len(prompt) - 1 + step, tok].item()) < TOL, step
    assert outs["a"]["meta_info"]["decode_steps"] == 24


def test_warm_up_leaves_a_clean_engine_that_computes_the_same():
    """The start-up warm-up (on by default on CUDA, asked for here on the CPU) takes the prefill, cascade,
    mixed-batch and logprob paths, then leaves an engine with an empty cache, zero counters and no event
    history, whose results equal an engine that never warmed up."""
    from sgnb.engine import Engine

    prompts = [f"{PROMPT} Variant {i}:" for i in range(3)]
    with Engine("dummy:tiny", quantization="none") as cold:
        assert cold.warmup_seconds == 0.0  # the CPU default: no warm-up
        want = cold.generate(prompts, {"max_new_tokens": 6, "temperature": 0.0}, return_logprob=True)
        cold_cached = cold.get_stats()["cached_tokens"]  # the prompts share a prefix with each other
    with Engine("dummy:tiny", quantization="none", warmup=True) as warm:
        stats = warm.get_stats()
        assert stats["warmup_seconds"] > 0
        assert stats["prompt_tokens"] == stats["generated_tokens"] == stats["prefill_batches"] == 0
        assert stats["kv_cached"] == 0 and stats["kv_free"] == stats["kv_total"]
        assert warm.event_history() == [] and warm.tree_snapshot()["total_tokens"] == 0
        got = warm.generate(prompts, {"max_new_tokens": 6, "temperature": 0.0}, return_logprob=True)
        assert warm.get_stats()["cached_tokens"] == cold_cached  # nothing of the warm-up's was left to hit
    for a, b in zip(want, got):
        la = [t[0] for t in a["meta_info"]["output_token_logprobs"]]
        lb = [t[0] for t in b["meta_info"]["output_token_logprobs"]]
        assert a["output_ids"] == b["output_ids"]
        assert max(abs(x - y) for x, y in zip(la, lb)) < TOL


def test_gil_switch_interval_is_set_while_the_engine_runs_and_restored():
    import sys

    from sgnb.engine import Engine

    before = sys.getswitchinterval()
    with Engine("dummy:tiny", quantization="none") as cpu_default:  # the CPU default leaves it alone
        assert sys.getswitchinterval() == before and cpu_default.is_alive
    with Engine("dummy:tiny", quantization="none", gil_switch_interval=0.001):
        assert sys.getswitchinterval() == pytest.approx(0.001)
    assert sys.getswitchinterval() == before
    with pytest.raises(ValueError, match="gil_switch_interval"):
        Engine("dummy:tiny", gil_switch_interval=0.0)


def test_gc_threshold_is_raised_while_the_engine_runs_and_restored():
    import gc

    from sgnb.engine import Engine
    from sgnb.engine.engine import GC_YOUNG_THRESHOLD

    before = gc.get_threshold()
    try:
        gc.set_threshold(700, *before[1:])
        with Engine("dummy:tiny", quantization="none"):
            assert gc.get_threshold() == (GC_YOUNG_THRESHOLD, *before[1:])
        assert gc.get_threshold() == (700, *before[1:])
        with Engine("dummy:tiny", quantization="none", gc_threshold=0):  # 0: the interpreter's own
            assert gc.get_threshold() == (700, *before[1:])
        gc.set_threshold(10 * GC_YOUNG_THRESHOLD, *before[1:])  # a caller's larger one is not lowered
        with Engine("dummy:tiny", quantization="none"):
            assert gc.get_threshold()[0] == 10 * GC_YOUNG_THRESHOLD
        gc.set_threshold(700, *before[1:])
        with Engine("dummy:tiny", quantization="none"):
            gc.set_threshold(1234, *before[1:])  # changed by someone else meanwhile: left as they set it
        assert gc.get_threshold()[0] == 1234
        for bad in (-1, 1.5, True):
            with pytest.raises(ValueError, match="gc_threshold"):
                Engine("dummy:tiny", gc_threshold=bad)
    finally:
        gc.set_threshold(*before)


def test_warm_up_fits_a_small_engine():
    """A small KV pool and a short context: the warm-up takes only what fits, and the engine starts."""
    from sgnb.engine import Engine

    with Engine("dummy:tiny", quantization="none", warmup=True, max_total_tokens=200, context_length=128) as eng:
        assert eng.get_stats()["prompt_tokens"] == 0 and eng.is_alive
        out = eng.generate(input_ids=list(range(100, 140)), sampling_params={"max_new_tokens": 3, "temperature": 0})
        assert out["meta_info"]["completion_tokens"] == 3


def test_stats_count_eager_forwards_and_name_the_slowest(engine):
    """get_stats() counts the forwards that ran outside a CUDA graph (all of them on the CPU) and names the
    slowest few by shape, longest first: where a benchmark's forward time went."""
    before = engine.get_stats()
    ids = _ids(engine, PROMPT)
    engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 3, "temperature": 0, "ignore_eos": True})
    after = engine.get_stats()
    assert after["eager_forwards"] - before["eager_forwards"] >= 3  # one prefill and >= 2 decode steps
    assert after["eager_forward_seconds"] > before["eager_forward_seconds"]
    slowest = after["slowest_forwards"]
    assert 1 <= len(slowest) <= 8
    assert [s["seconds"] for s in slowest] == sorted((s["seconds"] for s in slowest), reverse=True)
    assert any(s["forward"].startswith(f"extend tokens={len(ids)} requests=1 ") for s in slowest) or \
        len(slowest) == 8
    assert all(s["forward"].endswith(" eager") for s in slowest)


def test_stats_say_how_long_the_device_computed(engine):
    """device_seconds (engine/device_time.py: on a CPU the wall time of forwards, sampling and prompt logprobs) and
    the scheduler thread's CPU time grow with work, and device time stays within the run's wall time."""
    import time

    before = engine.get_stats()
    t0 = time.perf_counter()
    engine.generate("The capital of France is", {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
    engine.score("The sky is", [" blue", " green"], "token_length_normalized")
    wall = time.perf_counter() - t0
    after = engine.get_stats()
    device = after["device_seconds"] - before["device_seconds"]
    assert 0 < device <= wall
    assert device >= 0.5 * (after["forward_seconds"] - before["forward_seconds"])  # the forwards are spans
    assert after["scheduler_cpu_seconds"] > before["scheduler_cpu_seconds"]


def test_each_phase_counts_its_cpu_time_within_its_wall_time(engine):
    """phase_cpu_seconds: the scheduler thread's CPU time in each phase of phase_seconds grows with work and stays
    within that phase's wall time."""
    before = engine.get_stats()
    engine.generate("The capital of France is", {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
    engine.score("The sky is", [" blue", " green"], "token_length_normalized")
    after = engine.get_stats()
    wall = {k: after["phase_seconds"][k] - before["phase_seconds"][k] for k in after["phase_seconds"]}
    cpu = {k: after["phase_cpu_seconds"][k] - before["phase_cpu_seconds"][k] for k in after["phase_cpu_seconds"]}
    assert set(cpu) == set(wall)
    for k in cpu:
        assert 0 <= cpu[k] <= wall[k] + 2e-3, (k, cpu[k], wall[k])  # clocks read a few microseconds apart
    assert cpu["forward"] > 0 and cpu["advance"] > 0 and cpu["logprobs"] > 0
