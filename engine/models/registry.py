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


def build_model(config: ModelConfig, source: ModelSource, device: torch.device, dtype: torch.dtype,
                max_positions: int, tp: TPGroup | None = None, seed: int = 0) -> nn.Module:
    """The model for `source` on `device`, in eval mode, holding `tp`'s shard (the whole model when None)."""
    from sgnb.engine.model_loader import load_state_dict

    cls = model_class(config)
    with torch.device("meta"):
        model = cls(config, max_positions, tp)
    if source.dummy:
        model.init_dummy_weights(device, dtype, seed)
    else:
        sharded = tp is not None and tp.size > 1
        state = load_state_dict(source, device, dtype, shard=model.shard_hf if sharded else None)
        model.load_hf_state_dict(state, device, dtype)
    return model.eval()
