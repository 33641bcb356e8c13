"""Gemma 3 text decoder (Gemma3ForCausalLM; the language model of the 4B/12B/27B image-text checkpoints).

The Llama layers with what Gemma 3 changes: four norms per layer (a norm after attention and after the MLP,
before each is added to the residual, beside the usual two before them), RMSNorms that scale by (1 + w) (the
model stores 1 + w, added at load: `norm_offset`), q/k RMSNorm per head, GeGLU (gelu_pytorch_tanh), input
embeddings scaled by sqrt(hidden_size) (rounded to the weights' dtype, as transformers does), and interleaved
sliding-window and global layers (config.layer_types), the sliding ones with their own RoPE base and no rope
scaling (Attention.rope_kind). Attention scores scale by query_pre_attn_scalar ** -0.5.

Checkpoints of the image-text models name the decoder's tensors `language_model.model.*` (or
`model.language_model.*`) beside a vision tower: `checkpoint_name` maps them to the text model's names and
drops the rest.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from sgnb.engine.forward_batch import ForwardBatch
from sgnb.engine.model_config import ModelConfig
from sgnb.engine.models.llama import DecoderLayer, LlamaForCausalLM, RMSNorm
from sgnb.engine.tensor_parallel import TPGroup


class Gemma3DecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TPGroup) -> None:
        super().__init__(cfg, layer_id, tp)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                ropes: dict[str, tuple[torch.Tensor, torch.Tensor]],
                fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) -> (this layer's normed MLP output, the running sum before it):
        h = residual + post_attn_norm(attn(input_norm(residual))), out = h + post_ff_norm(mlp(pre_ff_norm(h))),
        each sum inside the next norm (fused add + RMSNorm)."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.post_attention_layernorm(self.self_attn(h, positions, ropes, fb))
        h, residual = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class Gemma3ForCausalLM(LlamaForCausalLM):
    layer_cls: ClassVar[type[DecoderLayer]] = Gemma3DecoderLayer
    norm_offset: ClassVar[float] = 1.0

    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TPGroup | None = None) -> None:
        super().__init__(cfg, max_positions, tp)
        self.fused_decode = False  # our C decode kernel computes Llama layers only

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(ids)  # (T, hidden)
        scale = float(torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype))  # rounded as transformers does
        return x * scale

    @staticmethod
    def checkpoint_name(name: str) -> str | None:
        """The text model's name of checkpoint tensor `name`; None for the vision tower and projector."""
        for prefix, ours in (("language_model.model.", "model."), ("model.language_model.", "model."),
                             ("language_model.lm_head.", "lm_head.")):
            if name.startswith(prefix):
                return ours + name[len(prefix):]
        if name.startswith(("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                            "model.multi_modal_projector.")):
            return None
        return name
