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
