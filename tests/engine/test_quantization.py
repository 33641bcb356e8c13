"""The CPU engine's default weight quantization against exact fp32 on the real default model (the quality guard).

The session `engine` fixture is exact fp32 (quantization="none"); here an int8 / int4 engine on the same weights
must stay close: prompt logprobs, teacher-forced decode logprobs, and the choices `select` makes.
"""

from __future__ import annotations

import pytest
import torch

PROMPTS = [
    "The radix tree keeps the KV cache of every prompt it has seen, so a later request that shares a prefix "
    "skips recomputing it.",
    "Question: What is the capital of France?\nAnswer: The capital of France is Paris, its largest city.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
]
QUESTIONS = [
    ("The sky on a clear day is", [" blue", " green", " purple", " loud"]),
    ("Water freezes at a temperature of zero degrees", [" Celsius", " meters", " kilograms", " volts"]),
    ("The opposite of hot is", [" cold", " tall", " fast", " heavy"]),
    ("A baby cat is called a", [" kitten", " puppy", " calf", " foal"]),
    ("Two plus two equals", [" four", " seven", " eleven", " none"]),
    ("The largest planet in our solar system is", [" Jupiter", " Mercury", " Pluto", " the Moon"]),
    ("Bees make", [" honey", " steel", " glass", " paper"]),
    ("To see in the dark you turn on a", [" light", " spoon", " chair", " shoe"]),
]


@pytest.fixture(scope="module", params=["auto", "int8"])
def quantized(request):
    from sgnb.engine import Engine

    eng = Engine("smollm2", quantization=request.param)
    yield eng
    eng.shutdown()


def _prompt_logprobs(engine, ids: list[int], start: int = 0) -> torch.Tensor:
    out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                          logprob_start_len=start)
    return torch.tensor([lp for lp, _, _ in out["meta_info"]["input_token_logprobs"] if lp is not None])


def test_cpu_default_picks_int4_where_lossless():
    """The default model's linears came from a Q4_1 GGUF: int4 groups hold them exactly; the head (Q8_0 in the
    GGUF) takes q8, exact too (bf16 where our kernel could not be built). Random (dummy) weights are not on a
    4-bit grid: int8, and a bf16 head."""
    from sgnb.engine import Engine
    from sgnb.kernels import native

    head = "q8 x1" if native.available() else "bf16 x1"
    with Engine("smollm2", max_total_tokens=256) as eng:
        assert eng.get_stats()["quantization"] == f"auto: int4 x120, {head}"
    with Engine("dummy:tiny", device="cpu", max_total_tokens=256) as eng:
        assert eng.get_stats()["quantization"] == "auto: bf16 x1, int8 x8"
    with pytest.raises(ValueError, match="quantization must be one of"):
        Engine("dummy:tiny", device="cpu", quantization="fp4")


def test_prompt_logprobs_stay_close_to_fp32(engine, quantized):
    diffs = []
    for p in PROMPTS:
        ids = engine.tokenizer.encode(p)
        diffs.append((_prompt_logprobs(quantized, ids) - _prompt_logprobs(engine, ids)).abs())
    d = torch.cat(diffs)
    # auto: int4 is exact for these linears and the head holds its Q8_0 weights exactly; these prompts are
    # short (<= 64 tokens), so they run the one-call CPU forward, whose GEMVs round the activations to int8 per
    # block of 32 as decode does (0.051 measured on 2026-12-02; under 0.04 when every prompt took the dense
    # copy). int8 re-quantizes weights that sit on a 4-bit grid onto a per-row 8-bit one (~1% weight error)
    auto = quantized.get_stats()["quantization"].startswith("auto")
    print(f"mean |logprob diff| vs fp32: {d.mean():.4f} (max {d.max():.3f})")
    assert d.mean() < (0.07 if auto else 0.1), d.mean()
    assert d.max() < 1.0, d.max()


def test_decode_logprobs_stay_close_to_fp32(engine, quantized):
    """Decode steps run the packed weights (batch <= SMALL_M rows): their logprobs, teacher-forced by the fp32
    engine on the same tokens."""
    ids = engine.tokenizer.encode(PROMPTS[0])
    out = quantized.generate(input_ids=ids, sampling_params={"max_new_tokens": 16, "temperature": 0,
                                                             "ignore_eos": True}, return_logprob=True)
    got = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
    want = _prompt_logprobs(engine, ids + out["output_ids"], start=len(ids))
    d = (got - want).abs()
    assert d.mean() < 0.15, d


def test_select_agrees_with_fp32(engine, quantized):
    agree = 0
    for prefix, choices in QUESTIONS:
        a = quantized.score(prefix, choices)["index"]
        b = engine.score(prefix, choices)["index"]
        agree += a == b
    assert agree == len(QUESTIONS)
