"""Tensor parallelism on CPU (gloo): tp_size=2 gives tp_size=1's logprobs on the real default model (whose 3 KV
heads split 2 + 1); tp_size=1 through a worker process equals the in-process runner; a dead worker fails
requests with an error naming it, and no worker outlives its engine, even when the engine's process is killed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from sgnb.engine import Engine, EngineConfig
from sgnb.engine.engine import EngineError
from sgnb.engine.model_config import ModelConfig
from sgnb.engine.tensor_parallel import shard_layout

TOL = 1e-4  # fp32 logprobs; the all-reduces sum partial products in another order (~1e-5 apart)

PROMPT = ("The radix tree keeps the KV cache of every prompt it has seen, so a later request that shares a "
          "prefix skips recomputing it. Here is a short story about a cat named Mo:")


@pytest.fixture(scope="module")
def tp2():
    eng = Engine("smollm2", tp_size=2, device="cpu", quantization="none")
    yield eng
    eng.shutdown()


def _greedy(engine, prompt, n=8, **kw):
    return engine.generate(prompt, {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
                           return_logprob=True, **kw)


def _assert_same(a: dict, b: dict) -> None:
    """Same tokens and logprobs (prompt and output, top-k included) within TOL."""
    assert a["output_ids"] == b["output_ids"]
    ma, mb = a["meta_info"], b["meta_info"]
    assert ma["cached_tokens"] == mb["cached_tokens"]
    for key in ("input_token_logprobs", "output_token_logprobs"):
        xs, ys = ma[key], mb[key]
        assert [t for _, t, _ in xs] == [t for _, t, _ in ys]
        diffs = [abs(x - y) for (x, _, _), (y, _, _) in zip(xs, ys) if x is not None]
        assert not diffs or max(diffs) < TOL, (key, max(diffs))
    for key in ("input_top_logprobs", "output_top_logprobs"):
        for xs, ys in zip(ma.get(key, []), mb.get(key, [])):
            if xs is not None:
                assert max(abs(x - y) for (x, _, _), (y, _, _) in zip(xs, ys)) < TOL


# ---- the shard layout ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("heads,kv_heads,tp", [(9, 3, 1), (9, 3, 2), (9, 3, 3), (9, 3, 4), (9, 3, 9), (32, 8, 3),
                                               (32, 8, 16), (4, 2, 4), (12, 1, 5)])
def test_shard_layout_splits_by_kv_group(heads, kv_heads, tp):
    cfg = ModelConfig("llama", vocab_size=49153, hidden_size=64, intermediate_size=1537, num_hidden_layers=1,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=8)
    group = heads // kv_heads
    layouts = [shard_layout(cfg, r, tp) for r in range(tp)]
    owner = []
    for lay in layouts:
        assert lay.num_heads >= 1 and lay.num_kv_heads >= 1
        # a rank's query heads all read its own KV heads, in the same grouping as the whole model
        assert {h // group for h in range(*lay.heads)} == set(range(*lay.kv_heads))
        assert lay.num_heads % lay.num_kv_heads == 0
        owner += list(range(*lay.heads))
    assert owner == list(range(heads))  # every head exactly once, in order
    assert {k for lay in layouts for k in range(*lay.kv_heads)} == set(range(kv_heads))
    for unit, n in (("intermediate", 1537), ("vocab", 49153)):
        spans = [getattr(lay, unit) for lay in layouts]
        assert spans[0][0] == 0 and spans[-1][1] == n and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        assert max(b - a for a, b in spans) - min(b - a for a, b in spans) <= 1


def test_default_model_split_in_two():
    from sgnb.engine.model_loader import resolve_model

    cfg = resolve_model("smollm2").config  # 9 heads, 3 KV heads, MLP 1536, vocab 49152
    r0, r1 = shard_layout(cfg, 0, 2), shard_layout(cfg, 1, 2)
    assert (r0.kv_heads, r0.heads, r1.kv_heads, r1.heads) == ((0, 2), (0, 6), (2, 3), (6, 9))
    assert (r0.intermediate, r1.intermediate, r0.vocab, r1.vocab) == ((0, 768), (768, 1536), (0, 24576),
                                                                       (24576, 49152))


def test_tracked_req_to_token_writes_keep_a_copy_equal():
    """The workers' copy of req_to_token, updated from take_writes before each forward, equals the table."""
    import torch

    from sgnb.engine.kv_pool import ReqToTokenPool

    gen = torch.Generator().manual_seed(0)
    pool = ReqToTokenPool(6, 40, torch.device("cpu"), track_writes=True)
    copy = torch.zeros_like(pool.req_to_token)
    for step in range(100):
        for _ in range(int(torch.randint(0, 4, (1,), generator=gen))):
            row = int(torch.randint(0, 6, (1,), generator=gen))
            start = int(torch.randint(0, 30, (1,), generator=gen))
            n = int(torch.randint(0, 10, (1,), generator=gen))
            pool.write(row, start, torch.randint(0, 5, (n,), generator=gen).numpy())  # often equal: not resent
        rows = torch.randperm(6, generator=gen)[:3].tolist()
        pool.write_points(rows, torch.randint(0, 40, (3,), generator=gen).tolist(),
                          torch.randint(0, 99, (3,), generator=gen).numpy())
        r, c, v = pool.take_writes()
        copy[r, c] = torch.from_numpy(v)  # as the workers do
        assert torch.equal(copy, pool.req_to_token), step
    assert all(len(t) == 0 for t in pool.take_writes())


@pytest.mark.parametrize("tp", [2, 3])
def test_dummy_weights_are_the_same_model_at_every_tp_size(tp):
    """Random (dummy) weights are drawn whole per tensor and then sharded: each rank holds its slice of the
    tp_size=1 model, so tp runs on random weights (the GPU checks) can be compared with tp_size=1."""
    import torch

    from sgnb.engine.model_loader import resolve_model
    from sgnb.engine.models.llama import LlamaForCausalLM
    from sgnb.engine.tensor_parallel import TPGroup

    cfg = resolve_model("dummy:tiny").config
    with torch.device("meta"):
        whole = LlamaForCausalLM(cfg, 64)
    whole.init_dummy_weights(torch.device("cpu"), torch.float32, seed=5)
    full = dict(whole.named_parameters())
    for rank in range(tp):
        with torch.device("meta"):
            part = LlamaForCausalLM(cfg, 64, TPGroup(shard_layout(cfg, rank, tp), process_group=object()))
        part.init_dummy_weights(torch.device("cpu"), torch.float32, seed=5)
        for name, p in part.named_parameters():
            torch.testing.assert_close(p, part.shard_tensor(name, full[name]), rtol=0, atol=0)


def test_tp_options_are_validated():
    with pytest.raises(ValueError, match="tp_size"):
        EngineConfig(tp_size=0)
    with pytest.raises(ValueError, match="tp_size"):
        EngineConfig(tp_size=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="attention heads"):  # dummy:tiny has 4 heads; nothing is spawned
        Engine("dummy:tiny", tp_size=5, device="cpu")


def test_tp_flag_of_the_magic_and_the_cli():
    from sgnb.cli import engine_kwargs
    from sgnb.kernel_ext.engine_magics import PARSER

    args = PARSER.parse_args(["model", "smollm2", "--tp", "2", "--device", "cpu"])
    assert engine_kwargs(args) == {"model_path": "smollm2", "tp_size": 2, "device": "cpu"}
    args = PARSER.parse_args(["model", "smollm2", "--tp-size", "1", "--tp-workers"])
    assert engine_kwargs(args)["tp_workers"] is True


# ---- tp_size=2 equals tp_size=1 -----------------------------------------------------------------------------
@pytest.mark.slow
def test_tp2_prompt_and_decode_logprobs_match_tp1(engine, tp2):
    assert tp2.runner.placement == "cpu (2 tensor-parallel workers)"
    assert tp2.runner.kv_pool.size == engine.runner.kv_pool.size
    for eng in (engine, tp2):
        eng.flush_cache()
    # prompt logprobs at every position: rows other than the last come from a second round trip
    a, b = (_greedy(eng, PROMPT, n=8, logprob_start_len=0, top_logprobs_num=3) for eng in (engine, tp2))
    assert len(a["meta_info"]["input_token_logprobs"]) > 30
    _assert_same(a, b)


@pytest.mark.slow
def test_tp2_decode_on_cached_prefix_matches_tp1(engine, tp2):
    for eng in (engine, tp2):
        eng.flush_cache()
        eng.generate(PROMPT, {"max_new_tokens": 0})  # cache the prompt
    longer = PROMPT + " Mo liked"
    a, b = (_greedy(eng, longer, n=12, top_logprobs_num=2) for eng in (engine, tp2))
    assert b["meta_info"]["cached_tokens"] > 30
    _assert_same(a, b)


@pytest.mark.slow
def test_tp2_batch_matches_tp1(engine, tp2):
    """Batches of several requests: all sharing a cached prefix (attended once: cascade attention), and mixed."""
    shared = [PROMPT + f" Chapter {i}." for i in range(4)]
    mixed = [PROMPT + " The end.", "Unrelated: the sea is", "Hi"]
    sp = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
    outs = []
    for eng in (engine, tp2):
        eng.flush_cache()
        eng.generate(PROMPT, {"max_new_tokens": 0})
        outs.append([*eng.generate(shared, sp, return_logprob=True, top_logprobs_num=2),
                     *eng.generate(mixed, sp, return_logprob=True, top_logprobs_num=2)])
    assert all(o["meta_info"]["cached_tokens"] > 30 for o in outs[1][:4])
    for a, b in zip(*outs):
        _assert_same(a, b)
    # choice scoring reads prompt logprobs of several requests at once
    choices = [" a dog", " a cat", " a bird"]
    sa, sb = (eng.score(PROMPT + " Mo is", choices) for eng in (engine, tp2))
    assert sa["index"] == sb["index"]
    assert sa["normalized_prompt_logprobs"] == pytest.approx(sb["normalized_prompt_logprobs"], abs=TOL)
    stats = tp2.get_stats()
    assert stats["tp_size"] == 2 and stats["requests_failed"] == 0


@pytest.mark.slow
def test_tp1_through_a_worker_equals_in_process(engine):
    with Engine("smollm2", tp_workers=True, device="cpu", quantization="none") as eng:
        assert eng.runner.placement == "cpu (1 tensor-parallel worker)"
        for e in (engine, eng):
            e.flush_cache()
        a, b = (_greedy(e, PROMPT, n=8, logprob_start_len=0, top_logprobs_num=3) for e in (engine, eng))
        _assert_same(a, b)
        prompts = [PROMPT + " Then", PROMPT + " Later", "Hello"]
        for x, y in zip(*(e.generate(prompts, {"max_new_tokens": 6, "temperature": 0}, return_logprob=True)
                          for e in (engine, eng))):
            _assert_same(x, y)


# ---- failures and processes ---------------------------------------------------------------------------------
def _children() -> set[int]:
    """Live child processes of this one (multiprocessing's resource tracker is shared, not ours)."""
    out = set()
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(p.cmdline()):
                out.add(p.pid)
        except psutil.NoSuchProcess:
            pass
    return out


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.slow
def test_worker_killed_mid_request_fails_it_and_the_engine_shuts_down_clean():
    before = _children()
    eng = Engine("dummy:tiny", tp_size=2, device="cpu", max_total_tokens=8192)
    pids = eng.runner.worker_pids
    assert set(pids) <= _children() - before
    assert eng.generate("warm up", {"max_new_tokens": 2})["meta_info"]["finish_reason"]["type"] == "length"
    box = {}
    t = threading.Thread(target=lambda: box.update(out=eng.generate(
        "a long one", {"max_new_tokens": 3000, "ignore_eos": True})))
    t.start()
    deadline = time.monotonic() + 30
    while eng.get_stats()["decode_steps"] < 5 and time.monotonic() < deadline:
        time.sleep(0.005)
    os.kill(pids[1], signal.SIGKILL)
    t.join(timeout=30)
    meta = box["out"]["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    assert "worker rank 1" in meta["error"] and "SIGKILL" in meta["error"], meta["error"]
    assert not eng.is_alive
    with pytest.raises(EngineError, match="worker rank 1"):
        eng.generate("next", {"max_new_tokens": 2})
    t0 = time.monotonic()
    eng.shutdown()
    assert time.monotonic() - t0 < 15
    assert all(_gone(p) for p in pids)
    assert _children() <= before


@pytest.mark.slow
def test_worker_killed_while_idle_is_reported_at_the_next_request():
    before = _children()
    eng = Engine("dummy:tiny", tp_workers=True, device="cpu", max_total_tokens=1024)
    (pid,) = eng.runner.worker_pids
    eng.generate("fine", {"max_new_tokens": 2})
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while eng.is_alive and time.monotonic() < deadline:  # noticed without a request in flight
        time.sleep(0.01)
    assert not eng.is_alive
    with pytest.raises(EngineError, match=r"worker rank 0 \(pid \d+\) was killed by signal 9"):
        eng.generate("next", {"max_new_tokens": 2})
    eng.shutdown()
    assert _children() <= before


@pytest.mark.slow
def test_workers_exit_when_the_engine_process_is_killed():
    """A kernel killed with SIGKILL cannot clean up: its workers notice and exit (here while busy)."""
    code = """if True:
        import json, sys, threading
        from sgnb.engine import Engine
        eng = Engine("dummy:tiny", tp_size=2, device="cpu", max_total_tokens=8192)
        eng.generate("warm up", {"max_new_tokens": 1})
        threading.Thread(target=lambda: eng.generate("busy", {"max_new_tokens": 4000, "ignore_eos": True}),
                         daemon=True).start()
        print(json.dumps(eng.runner.worker_pids), flush=True)
        threading.Event().wait()
    """
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line, "the engine process did not start"
        pids = json.loads(line)
        assert not any(_gone(p) for p in pids)
        time.sleep(0.3)  # let the workers get into a forward
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 10
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_gone(p) for p in pids)
