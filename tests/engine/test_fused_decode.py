"""The CPU decode forward in one call of our C kernel (kernels/native.decode_layers, LlamaForCausalLM's fused
path) against the module path on the same batches.

Both paths round each linear's input rows to int8 per block; a last-bit difference upstream (the C norm sums
in another order than torch) can move one element across a rounding boundary, which moves that linear's output
by one activation step. On the real model the two agree to that quantization noise (up to ~2% relative per
step measured; a wrong rotation shows up as ~50%), and both are held to the exact fp32 model by the quality
guard in test_quantization.py; on random weights, where no element sits that close to an edge, to 1e-3.
"""

from __future__ import annotations

import json

import pytest
import torch

from sgnb.kernels import native

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.unavailable_reason()}")


def _both_paths(eng, prompts, new_tokens=6, extends=None):
    """Generate with every decode forward run both ways on the same batch; returns the per-step relative
    differences and batch sizes. The module path's output is the one the engine continues with. Extends that
    take the fused path (few tokens) are compared too, into the list `extends` when one is given."""
    from sgnb.engine.forward_batch import ForwardBatch, ForwardMode

    runner, model = eng.runner, eng.runner.model
    steps = []

    def forward(spec):
        fb = ForwardBatch.build(spec, runner.req_pool.req_to_token, runner.device)
        fb.attn_backend = runner.attn
        runner.attn.init_forward_metadata(fb)
        model.fused_decode = False
        want = model(fb).clone()
        model.fused_decode = True
        before = model.fused_steps
        got = model(fb)
        if fb.mode is ForwardMode.DECODE:
            assert model.fused_steps == before + 1, "the fused path did not run"
            steps.append((((got - want).norm() / want.norm()).item(), fb.batch_size))
        elif model.fused_steps == before + 1 and extends is not None:
            extends.append((((got - want).norm() / want.norm()).item(), fb.num_tokens))
        return want

    runner.forward = forward
    outs = eng.generate(prompts, [{"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}] * len(prompts))
    assert all(o["meta_info"]["completion_tokens"] == new_tokens for o in outs), [o["meta_info"].get("finish_reason") for o in outs][:2]
    return steps


def test_fused_decode_equals_the_module_path_on_the_default_model():
    from sgnb.engine import Engine

    prompts = ["The capital of France is", "def fib(n):\n    " * 20, "Once upon a time, in a land far away, " * 12]
    with Engine("smollm2", max_total_tokens=4096) as eng:
        steps = _both_paths(eng, prompts)
    assert steps and max(b for _, b in steps) == 3  # the three requests decoded in one batch
    assert max(d for d, _ in steps) < 0.06, steps


def test_fused_decode_with_qkv_bias_and_fragmented_slots(tmp_path):
    """A Qwen2-style q/k/v bias on random int4 weights; 64 requests whose slots interleave, so every row reads
    its keys through a scattered slot table."""
    from pathlib import Path

    import sgnb.engine.models as models
    from sgnb.engine import Engine

    cfg = json.loads((Path(models.__file__).parent / "configs" / "tiny.json").read_text())
    cfg.update(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=128, intermediate_size=256, num_attention_heads=8,
               num_key_value_heads=2)
    path = tmp_path / "tiny-bias.json"
    path.write_text(json.dumps(cfg))
    with Engine(f"dummy:{path}", device="cpu", quantization="int4", max_total_tokens=4096) as eng:
        bias = eng.runner.model.model.layers[0].self_attn.qkv_proj.bias
        assert bias is not None
        with torch.no_grad():
            for layer in eng.runner.model.model.layers:
                layer.self_attn.qkv_proj.bias.normal_(0.0, 2.0)  # sharp attention: positions matter
        for layer in eng.runner.model.modules():  # the module path on our kernels at every size too (not the
            if getattr(layer, "_native", None):     # dense copy past 16 rows): the same arithmetic both ways
                layer.small_m = native.MAX_ROWS
        prompts = [f"request {i}: " + "word " * (3 * i + 1) for i in range(min(native.MAX_ROWS, 64))]
        steps = _both_paths(eng, prompts, new_tokens=4)
    assert max(b for _, b in steps) > 16  # (the rows in fours of the several-row GEMVs, and a last 1-3)
    assert max(d for d, _ in steps) < 1e-3, steps  # random weights: no element sits on a rounding edge


def _fused_by_batch(quantization: str, prompts: list[str]) -> list[tuple[int, bool]]:
    """(batch size, whether the fused path ran) of each decode step of a dummy model generating `prompts`
    together (3 tokens), then prompts[0] alone."""
    from sgnb.engine import Engine
    from sgnb.engine.forward_batch import ForwardMode

    with Engine("dummy:tiny", device="cpu", quantization=quantization, max_total_tokens=4096) as eng:
        model, seen = eng.runner.model, []
        inner = model.forward

        def forward(fb):
            before = model.fused_steps
            out = inner(fb)
            if fb.mode is ForwardMode.DECODE:
                seen.append((fb.batch_size, model.fused_steps == before + 1))
            return out

        model.forward = forward
        sp = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}
        eng.generate(prompts, sp)
        eng.generate(prompts[0], sp)
    return seen


def test_more_rows_than_the_kernel_takes_use_the_module_path():
    seen = _fused_by_batch("int4", ["x " * 5] * (native.MAX_ROWS + 4))
    assert any(b > native.MAX_ROWS for b, _ in seen) and any(b <= native.MAX_ROWS for b, _ in seen)
    assert all(fused == (b <= native.MAX_ROWS) for b, fused in seen), seen


def test_forks_sharing_a_cached_prefix_take_the_fused_path():
    """Forked programs decode as a group sharing a cached prefix (the module path's cascade); the fused path
    reads each row's keys whole and must give the same states."""
    from sgnb.engine import Engine

    prefix = "You are a helpful assistant. List three tips for writing clear code, with reasons. " * 6
    with Engine("smollm2", max_total_tokens=4096) as eng:
        eng.generate(prefix, {"max_new_tokens": 1})  # cache the prefix
        extends = []
        steps = _both_paths(eng, [prefix + f" Tip {i}:" for i in range(1, 6)], extends=extends)
    assert max(b for _, b in steps) == 5
    assert max(d for d, _ in steps) < 0.06, steps
    # the forks' own prompts after the cached prefix: one short extend of several rows per request, causal
    # within each request (row j sees the prefix and the request's first j + 1 new tokens)
    assert extends and max(t for _, t in extends) >= 10, extends
    assert max(d for d, _ in extends) < 0.06, extends


def test_float32_weights_take_the_fused_path_up_to_our_gemvs_rows():
    """The exact engine (quantization="none"): its linears are F32Linear (kernels/dense_linear.py), so decodes of
    up to F32_SMALL_M rows run in one call, equal to the module path to float32 rounding; more rows take the
    module path (torch's GEMM wins there)."""
    from sgnb.engine import Engine
    from sgnb.kernels.dense_linear import F32_SMALL_M, F32Linear

    prompts = [f"request {i}: " + "word " * (2 * i + 1) for i in range(F32_SMALL_M + 4)]
    with Engine("dummy:tiny", device="cpu", quantization="none", max_total_tokens=4096) as eng:
        model = eng.runner.model
        assert isinstance(model.model.layers[0].self_attn.qkv_proj, F32Linear) and isinstance(model.lm_head, F32Linear)
        steps = _both_paths(eng, prompts[:F32_SMALL_M], new_tokens=4)
        assert max(b for _, b in steps) == F32_SMALL_M
        assert max(d for d, _ in steps) < 1e-5, steps
    seen = _fused_by_batch("none", prompts)
    assert any(b > F32_SMALL_M for b, _ in seen) and any(b <= F32_SMALL_M for b, _ in seen), seen
    assert all(fused == (b <= F32_SMALL_M) for b, fused in seen), seen


def test_the_default_models_exact_engine_reads_the_weights_exact_codes():
    """The default model's weights came from Q4_1 / Q8_0 tensors, so in the exact engine each of its 121 linears
    (the head too) runs on int8 codes that stand for its float32 weight bit for bit (kernels/dense_linear.py,
    kind 33 of the one-call decode); the one-call decode equals the module path to float32 rounding."""
    from sgnb.engine import Engine
    from sgnb.kernels.dense_linear import F32Linear

    with Engine("smollm2", quantization="none", max_total_tokens=2048) as eng:
        layers = [m for m in eng.runner.model.modules() if isinstance(m, F32Linear)]
        assert len(layers) == 4 * 30 + 1 and all(layer.codes is not None for layer in layers)
        assert {native.linear_fields(layer)[0] for layer in layers} == {33}
        steps = _both_paths(eng, ["The capital of France is", "Once upon a time, a"], new_tokens=3)
        assert steps and max(d for d, _ in steps) < 1e-5, steps
