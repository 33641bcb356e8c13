"""FP8 weights through the engine on CPU (the reference path: dequantize, then matmul; the GPU's _scaled_mm and
Triton paths are checked by benchmarks/bench_moe_fp8.py on the device).

An FP8 checkpoint made here from a tiny random transformers checkpoint (per-tensor, per-channel and 128x128
block scales, in the tensor names real checkpoints use) must load and give the logprobs of the same model with
its weights dequantized and stored as float32 (transformers itself runs FP8 checkpoints only on a GPU);
quantization="fp8" on the float32 checkpoint must equal the checkpoint of its per-channel dequantized weights.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from sgnb.kernels.fp8_linear import FP8, dequantize_fp8, quantize_fp8, scales_to_rows

TOL = 1e-4
PROMPT = "The radix tree shares the KV cache of every prompt prefix between requests, so later ones skip it."
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    from sgnb.engine.model_loader import SMOLLM2_NAME, resolve_model

    path = tmp_path_factory.mktemp("fp32")
    # K = 64 and 160: whole and partial 128-column blocks; q (64 rows), k/v (32): partial 128-row blocks
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      initializer_range=0.1, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok = resolve_model(SMOLLM2_NAME).path
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok / name, path / name)
    return path


def _is_quantized(name: str) -> bool:
    return name.endswith(".weight") and name.split(".")[-2] in QUANTIZED


def write_fp8_checkpoint(src: Path, dst: Path, scheme: str) -> Path:
    """`src` with its linears as e4m3 + scales in the checkpoint form of `scheme` (dst), and the reference:
    the same weights dequantized, float32 (dst / "ref")."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(src / "model.safetensors"))
    fp8, ref = {}, {}
    for name, t in state.items():
        if not _is_quantized(name):
            fp8[name] = ref[name] = t
            continue
        q, scale = quantize_fp8(t, scheme)
        fp8[name] = q
        base = name.removesuffix(".weight")
        if scheme == "block":
            fp8[f"{base}.weight_scale_inv"] = scale
        else:
            fp8[f"{base}.weight_scale"] = scale if scheme == "tensor" else scale[:, None]
            fp8[f"{base}.input_scale"] = torch.tensor(0.01)  # a static scheme's: the engine scales per token
        ref[name] = dequantize_fp8(q, scales_to_rows(scale, tuple(t.shape), block=scheme == "block"))
    config = json.loads((src / "config.json").read_text())
    for out, tensors in ((dst, fp8), (dst / "ref", ref)):
        out.mkdir(parents=True)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(src / f, out / f)
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    quant = {"quant_method": "fp8", "activation_scheme": "dynamic" if scheme == "block" else "static"}
    if scheme == "block":
        quant["weight_block_size"] = [128, 128]
    (dst / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    (dst / "ref" / "config.json").write_text(json.dumps(config))
    return dst


def _logprobs(path: Path, **kw) -> tuple[list[float], list[int], str]:
    from sgnb.engine import Engine

    with Engine(str(path), device="cpu", dtype="float32", max_total_tokens=512, **kw) as eng:
        ids = eng.tokenizer.encode(PROMPT)
        out = eng.generate(input_ids=ids, sampling_params={"max_new_tokens": 5, "temperature": 0, "ignore_eos": True},
                           return_logprob=True, logprob_start_len=0)
        meta = out["meta_info"]
        lps = [lp for lp, _, _ in meta["input_token_logprobs"] + meta["output_token_logprobs"] if lp is not None]
        return lps, out["output_ids"], eng.get_stats()["quantization"]


@pytest.mark.parametrize("scheme", ["tensor", "channel", "block"])
def test_fp8_checkpoint_equals_dequantized_reference(llama_dir, tmp_path, scheme):
    from safetensors import safe_open

    dst = write_fp8_checkpoint(llama_dir, tmp_path / scheme, scheme)
    with safe_open(str(dst / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.layers.0.self_attn.q_proj.weight").dtype == FP8
    got, got_ids, quant = _logprobs(dst, quantization="none")
    want, want_ids, _ = _logprobs(dst / "ref", quantization="none")
    assert "fp8 x8" in quant  # 2 layers x (qkv, o, gate_up, down); the head as stored
    assert got_ids == want_ids
    assert max(abs(a - b) for a, b in zip(got, want)) < TOL


def test_quantize_at_load_equals_per_channel_dequantized(llama_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    ref = tmp_path / "ref"
    shutil.copytree(llama_dir, ref)
    state = load_file(str(llama_dir / "model.safetensors"))
    for name, t in state.items():
        if _is_quantized(name):
            q, scale = quantize_fp8(t, "channel")
            state[name] = dequantize_fp8(q, scale[:, None])
    save_file(state, str(ref / "model.safetensors"), metadata={"format": "pt"})
    got, got_ids, quant = _logprobs(llama_dir, quantization="fp8")
    want, want_ids, _ = _logprobs(ref, quantization="none")
    assert quant == "fp8: fp8 x8"
    assert got_ids == want_ids
    assert max(abs(a - b) for a, b in zip(got, want)) < TOL


def test_config_reads_quantization_config():
    from sgnb.engine.model_config import ModelConfig

    base = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 2}
    cfg = ModelConfig.from_hf_dict({**base, "quantization_config": {"quant_method": "fp8",
                                                                    "weight_block_size": [128, 128]}})
    assert (cfg.quant_method, cfg.weight_block_size) == ("fp8", (128, 128))
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    with pytest.raises(ValueError, match="quant_method 'awq'"):
        ModelConfig.from_hf_dict({**base, "quantization_config": {"quant_method": "awq"}})
    with pytest.raises(ValueError, match="weight_block_size"):
        ModelConfig.from_hf_dict({**base, "quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 64]}})
