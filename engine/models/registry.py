"""Which model class implements an architecture, and the one way every runner builds a model.

`build_model` is used by the in-process runner and by each tensor-parallel worker: built on the meta device
(no random init of weights about to be replaced), then random weights for `dummy:` models or the checkpoint's
(this rank's shards only) on the target device. A new architecture adds a line to `_ARCHITECTURES`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

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
    if name != "none" and device.type != "cpu":
        raise ValueError(f"quantization={name!r} is for the CPU engine (its kernels are torch's CPU weight-only "
                         "ones); on a GPU the model runs in bf16: use quantization='none' or 'auto'")
    return name


def build_model(config: ModelConfig, source: ModelSource, device: torch.device, dtype: torch.dtype,
                max_positions: int, tp: TPGroup | None = None, seed: int = 0, quantization: str = "none") -> nn.Module:
    """The model for `source` on `device`, in eval mode, holding `tp`'s shard (the whole model when None);
    with quantization "int8" / "int4" (CPU) its linear layers become QuantLinear (kernels/quant_linear.py)."""
    from sgnb.engine.model_loader import load_state_dict

    cls = model_class(config)
    with torch.device("meta"):
        model = cls(config, max_positions, tp)
    if source.dummy:
        model.init_dummy_weights(device, dtype, seed)
    else:
        sharded = tp is not None and tp.size > 1
        state = load_state_dict(source, device, dtype, shard=model.shard_hf if sharded else None,
                                rename=getattr(model, "checkpoint_name", None))
        model.load_hf_state_dict(state, device, dtype)
    if quantization != "none":
        from sgnb.kernels.quant_linear import quantize_linears

        counts = quantize_linears(model, quantization, QUANTIZED_LINEARS)
        model.quantized_layers = counts  # e.g. {"int4": 210, "bf16": 1}: logged and reported by the runner
    return model.eval()
