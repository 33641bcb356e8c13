"""Which model class implements an architecture, and the one way every runner builds a model.

`build_model` is used by the in-process runner and by each tensor-parallel worker: built on the meta device
(no random init of weights about to be replaced), then random weights for `dummy:` models or the checkpoint's
(this rank's shards only) on the target device. A new architecture adds a line to `_ARCHITECTURES`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from sgnb.engine.model_config import ModelConfig
    from sgnb.engine.model_loader import ModelSource
    from sgnb.engine.tensor_parallel import TPGroup

# ModelConfig.architecture (the HF model_type) -> "module:Class"
_ARCHITECTURES = {
    "llama": "sgnb.engine.models.llama:LlamaForCausalLM",
    "mistral": "sgnb.engine.models.llama:LlamaForCausalLM",
    "qwen2": "sgnb.engine.models.llama:LlamaForCausalLM",
    "mixtral": "sgnb.engine.models.moe:MoEForCausalLM",
    "qwen3_moe": "sgnb.engine.models.moe:MoEForCausalLM",
    "qwen3": "sgnb.engine.models.llama:LlamaForCausalLM",  # q/k norm: a config flag of the same layers
    "gemma3_text": "sgnb.engine.models.gemma3:Gemma3ForCausalLM",
    "llava": "sgnb.engine.models.llava:LlavaForConditionalGeneration",
    "llava_next": "sgnb.engine.models.llava:LlavaForConditionalGeneration",
    "llava_next_video": "sgnb.engine.models.llava:LlavaForConditionalGeneration",
}


def model_class(config: ModelConfig) -> type[nn.Module]:
    target = _ARCHITECTURES.get(config.architecture)
    if target is None:
        raise ValueError(f"no model implements architecture {config.architecture!r}; known: {sorted(_ARCHITECTURES)}")
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


# the linear layers that weight quantization replaces (the language model's; a vision tower's keep their names)
QUANTIZED_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")


def resolve_quantization(name: str, device: torch.device) -> str:
    """What `name` means on `device`: "none" on GPU for "auto"; ValueError where it cannot run."""
    if name == "auto":
        return "auto" if device.type == "cpu" else "none"
    if name not in ("none", "fp8") and device.type != "cpu":
        raise ValueError(f"quantization={name!r} is for the CPU engine (its kernels are torch's CPU weight-only "
                         "ones); on a GPU the model runs in bf16: use quantization='none' or 'auto'")
    return name


def build_model(config: ModelConfig, source: ModelSource, device: torch.device, dtype: torch.dtype,
                max_positions: int, tp: TPGroup | None = None, seed: int = 0, quantization: str = "none") -> nn.Module:
    """The model for `source` on `device`, in eval mode, holding `tp`'s shard (the whole model when None);
    with quantization "int8" / "int4" (CPU) its linear layers become QuantLinear (kernels/quant_linear.py),
    with "fp8" Fp8Linear (kernels/fp8_linear.py; the head stays in `dtype`). An FP8 checkpoint's linears are
    Fp8Linear whatever `quantization` says."""
    from sgnb.engine.model_loader import load_state_dict

    cls = model_class(config)
    with torch.device("meta"):
        model: Any = cls(config, max_positions, tp)  # a model class of _ARCHITECTURES (their loading methods)
    sharded = tp is not None and tp.size > 1
    if source.dummy:
        model.init_dummy_weights(device, dtype, seed)
    elif config.quant_method == "fp8":  # e4m3 weights: held as such (engine/models/fp8.py)
        from sgnb.engine.models.fp8 import adopt_fp8_linears, split_fp8_checkpoint

        if sharded:
            raise ValueError("FP8 checkpoints load at tp_size 1 for now; quantization='fp8' on a bf16 checkpoint "
                             "works at any tp_size")
        # stored dtypes: e4m3 weights, float32 scales
        state = load_state_dict(source, device, rename=getattr(model, "checkpoint_name", None))
        fp8 = split_fp8_checkpoint(state, config, dtype)
        model.load_hf_state_dict(state, device, dtype)
        model.quantized_layers = adopt_fp8_linears(model, fp8, QUANTIZED_LINEARS)
    else:
        state = load_state_dict(source, device, dtype, shard=model.shard_hf if sharded else None,
                                rename=getattr(model, "checkpoint_name", None))
        model.load_hf_state_dict(state, device, dtype)
    if quantization == "fp8":
        from sgnb.kernels.fp8_linear import quantize_linears_fp8

        counts = quantize_linears_fp8(model, QUANTIZED_LINEARS)
        previous = getattr(model, "quantized_layers", None) or {}
        model.quantized_layers = {"fp8": counts["fp8"] + previous.get("fp8", 0)}
    elif quantization != "none":
        from sgnb.engine.model_loader import quantized_weights_cache
        from sgnb.kernels import native
        from sgnb.kernels.quant_linear import quantize_linears

        cache = None if sharded or device.type != "cpu" else quantized_weights_cache(
            source, quantization, QUANTIZED_LINEARS, str(dtype), native.available())
        counts = quantize_linears(model, quantization, QUANTIZED_LINEARS, cache=cache)
        model.quantized_layers = counts  # e.g. {"int4": 210, "bf16": 1}: logged and reported by the runner
    elif device.type == "cpu" and dtype == torch.float32:  # exact weights: our GEMV for decode-sized batches
        from sgnb.engine.model_loader import quantized_weights_cache
        from sgnb.kernels import native
        from sgnb.kernels.dense_linear import may_have_exact_codes, use_f32_gemv
        from sgnb.kernels.quant_linear import stored_forms

        # weights from a 4-bit / 8-bit GGUF are exactly int8 codes per block: the GEMV reads those (a quarter of
        # the bytes). Their forms come from the file the default ("auto") engine caches its layers in
        cache = None if sharded or source.dummy else quantized_weights_cache(
            source, "auto", QUANTIZED_LINEARS, str(dtype), native.available())
        forms = stored_forms(model, "auto", QUANTIZED_LINEARS, cache=cache) \
            if cache is not None and native.available() and may_have_exact_codes(model, QUANTIZED_LINEARS) else None
        use_f32_gemv(model, QUANTIZED_LINEARS, forms)
    return model.eval()
