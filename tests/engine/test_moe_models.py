"""Mixture-of-experts models (engine/models/moe.py) against transformers on tiny random checkpoints.

Each checkpoint is written by transformers' own MixtralForCausalLM / Qwen3MoeForCausalLM from its config class
(fp32, CPU), loaded through our loader and run by the whole engine; transformers on the same files is the
oracle: prompt logprobs, greedy decode, decode over a cached prefix, a chunked prefill and a ragged batch.
The Qwen3-MoE config mixes sparse and dense layers (mlp_only_layers) and has norm_topk_prob off.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

TOL = 2e-4  # fp32 logprobs; summation order differs (experts are summed per token in another order)
PROMPT = ("You are a careful assistant. The radix tree shares the KV cache of every prompt prefix between "
          "requests, so later requests skip recomputing it.")
GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}


def _hf_config(arch: str):
    import transformers

    common = dict(vocab_size=49152, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, rope_theta=10000.0,
                  tie_word_embeddings=False, initializer_range=0.1, bos_token_id=1, eos_token_id=2)
    if arch == "mixtral":
        return transformers.MixtralConfig(intermediate_size=32, num_local_experts=6, num_experts_per_tok=2,
                                          **common)
    return transformers.Qwen3MoeConfig(intermediate_size=48, moe_intermediate_size=24, num_experts=8,
                                       num_experts_per_tok=3, norm_topk_prob=False, mlp_only_layers=[1], **common)


def write_checkpoint(arch: str, path: Path, seed: int = 0) -> Path:
    """A tiny random `arch` checkpoint in HF format with the SmolLM2 tokenizer, written by transformers."""
    import transformers

    from sgnb.engine.model_loader import SMOLLM2_NAME, resolve_model

    cls = {"mixtral": transformers.MixtralForCausalLM, "qwen3_moe": transformers.Qwen3MoeForCausalLM}[arch]
    torch.manual_seed(seed)
    model = cls(_hf_config(arch))
    with torch.no_grad():  # transformers initialises the router at zero (Qwen3-MoE): make routing matter
        for name, p in model.named_parameters():
            if name.endswith("gate.weight") and p.dim() == 2:
                p.normal_(0.0, 0.5)
    model.save_pretrained(path)
    tok_dir = Path(os.environ.get("SGNB_TEST_TOKENIZER") or resolve_model(SMOLLM2_NAME).path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok_dir / name, path / name)
    return path


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe"])
def moe(request, tmp_path_factory):
    """(engine, transformers model) on one tiny checkpoint."""
    import transformers

    from sgnb.engine import Engine

    path = write_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    eng = Engine(str(path), device="cpu", dtype="float32", quantization="none", max_total_tokens=2048,
                 chunked_prefill_size=16)
    yield eng, hf
    eng.shutdown()


def _hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].double().log_softmax(-1)  # (L, V)


def _check(out: dict, prompt: list[int], hf, start: int = 0) -> None:
    """The request's prompt logprobs (from `start`) and output logprobs equal transformers' on its text."""
    full = prompt + out["output_ids"]
    ref = _hf_logprobs(hf, full)
    got = [(i, lp) for i, (lp, _, _) in enumerate(out["meta_info"]["input_token_logprobs"], start) if lp is not None]
    for i, lp in got:
        assert abs(lp - ref[i - 1, prompt[i]].item()) < TOL, (i, lp, ref[i - 1, prompt[i]].item())
    for j, (lp, tok, _) in enumerate(out["meta_info"]["output_token_logprobs"]):
        assert abs(lp - ref[len(prompt) - 1 + j, tok].item()) < TOL, (j, lp)
        # greedy: the token is transformers' argmax (no near-ties at these logit scales; checked by the margin)
        top2 = ref[len(prompt) - 1 + j].topk(2)
        if top2.values[0] - top2.values[1] > 1e-3:
            assert tok == int(top2.indices[0])


def test_config_round_trips(moe):
    from sgnb.engine.model_config import ModelConfig

    eng, hf = moe
    cfg = eng.runner.model.config if hasattr(eng.runner, "model") else None
    d = hf.config.to_dict()
    ours = ModelConfig.from_hf_dict(d)
    assert ModelConfig.from_hf_dict(ours.to_hf_dict()) == ours
    assert cfg is None or cfg == ours
    if ours.architecture == "qwen3_moe":
        assert ours.moe.sparse_layers == (0, 2) and not ours.moe.norm_topk_prob and ours.qk_norm


def test_prompt_logprobs_and_greedy_decode(moe):
    eng, hf = moe
    eng.flush_cache()
    ids = eng.tokenizer.encode(PROMPT)
    assert len(ids) > 16  # the prompt takes two chunks (chunked_prefill_size=16)
    out = eng.generate(input_ids=ids, sampling_params=GREEDY, return_logprob=True, logprob_start_len=0)
    _check(out, ids, hf)


def test_decode_over_cached_prefix(moe):
    eng, hf = moe
    eng.flush_cache()
    ids = eng.tokenizer.encode(PROMPT)
    eng.generate(input_ids=ids, sampling_params={"max_new_tokens": 0})
    longer = ids + eng.tokenizer.encode(" Then it answers")
    out = eng.generate(input_ids=longer, sampling_params=GREEDY, return_logprob=True, logprob_start_len=len(ids))
    assert out["meta_info"]["cached_tokens"] >= len(ids) - 1
    _check(out, longer, hf, start=len(ids))


def test_ragged_batch(moe):
    eng, hf = moe
    eng.flush_cache()
    prompts = [eng.tokenizer.encode(PROMPT[:n]) for n in (9, 40, 77)]
    outs = eng.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True, logprob_start_len=0)
    for ids, out in zip(prompts, outs):
        _check(out, ids, hf)


def test_triton_backend_and_moe_kernel(moe, tmp_path):
    """The Triton attention backend and the fused-MoE Triton kernel (both in the interpreter on CPU) give
    transformers' logprobs too."""
    from sgnb.engine import Engine
    from sgnb.engine.models.moe import SparseMoE
    from sgnb.kernels.moe import _fused_moe_triton

    _, hf = moe
    path = write_checkpoint(hf.config.model_type, tmp_path / "ckpt")
    with Engine(str(path), device="cpu", dtype="float32", quantization="none", max_total_tokens=1024,
                attention_backend="triton") as eng:
        blocks = [m for m in eng.runner.model.modules() if isinstance(m, SparseMoE)]
        assert blocks
        for m in blocks:
            m.kernel = _fused_moe_triton
        ids = eng.tokenizer.encode(PROMPT[:60])
        out = eng.generate(input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": 3}, return_logprob=True,
                           logprob_start_len=0)
        _check(out, ids, hf)


@pytest.mark.slow
def test_tp2_equals_tp1(tmp_path):
    """Experts split over two gloo workers (each holds half of every expert's columns) give tp 1's logprobs."""
    from sgnb.engine import Engine

    path = write_checkpoint("qwen3_moe", tmp_path / "ckpt")
    prompts = [PROMPT, PROMPT[:30] + " and more"]
    outs = []
    for tp in (1, 2):
        with Engine(str(path), device="cpu", dtype="float32", quantization="none", max_total_tokens=1024,
                    tp_size=tp) as eng:
            outs.append(eng.generate(prompts, GREEDY, return_logprob=True, logprob_start_len=0))
    for a, b in zip(*outs):
        assert a["output_ids"] == b["output_ids"]
        for key in ("input_token_logprobs", "output_token_logprobs"):
            xs = [lp for lp, _, _ in a["meta_info"][key] if lp is not None]
            ys = [lp for lp, _, _ in b["meta_info"][key] if lp is not None]
            assert max(abs(x - y) for x, y in zip(xs, ys)) < 1e-4


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "mixtral-8x7b", "tiny-qwen3-moe"])
def test_dummy_configs_parse(name):
    from sgnb.engine.model_loader import resolve_model

    cfg = resolve_model(f"dummy:{name}").config
    assert cfg.moe is not None and cfg.moe.sparse_layers
    if name == "qwen3-30b-a3b":
        assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.intermediate_size, cfg.qk_norm) == (128, 8, 768, True)


@pytest.mark.parametrize("tp", [2, 3])
def test_dummy_experts_are_the_same_model_at_every_tp_size(tp):
    """Random experts are drawn whole and then sharded, as the dense tensors are (tp runs on dummy weights
    compare with tp 1)."""
    from sgnb.engine.model_loader import resolve_model
    from sgnb.engine.models.moe import MoEForCausalLM
    from sgnb.engine.tensor_parallel import TPGroup, shard_layout

    cfg = resolve_model("dummy:tiny-qwen3-moe").config
    with torch.device("meta"):
        whole = MoEForCausalLM(cfg, 64)
    whole.init_dummy_weights(torch.device("cpu"), torch.float32, seed=3)
    full = dict(whole.named_parameters())
    for rank in range(tp):
        with torch.device("meta"):
            part = MoEForCausalLM(cfg, 64, TPGroup(shard_layout(cfg, rank, tp), process_group=object()))
        part.init_dummy_weights(torch.device("cpu"), torch.float32, seed=3)
        for name, p in part.named_parameters():
            torch.testing.assert_close(p, part.shard_tensor(name, full[name]), rtol=0, atol=0)
        # rank's w13 holds the same columns of the gate and the up halves
        inter = cfg.moe.intermediate_size
        lo, hi = part.tp.layout.expert_intermediate
        w13 = part.model.layers[0].mlp.w13
        torch.testing.assert_close(w13[:, : hi - lo], full["model.layers.0.mlp.w13"][:, lo:hi], rtol=0, atol=0)
        torch.testing.assert_close(w13[:, hi - lo:], full["model.layers.0.mlp.w13"][:, inter + lo: inter + hi],
                                   rtol=0, atol=0)
