"""Mixture-of-experts decoders: Mixtral and Qwen3-MoE, the Llama-family model with expert MLP blocks.

Attention, norms, embeddings and the head are llama.py's (Qwen3-MoE adds its q/k RMSNorm through
ModelConfig.qk_norm); the MLP of each layer in `cfg.moe.sparse_layers` is a `SparseMoE`: a router (HF's
`gate`, replicated) picks each token's top-k experts, and kernels/moe.py's fused kernel runs them. Expert
weights are stacked per layer into `w13` (E, 2I, H: each expert's gate rows then up rows) and `w2` (E, H, I),
from HF's per-expert tensors (Mixtral: `block_sparse_moe.experts.N.w1/w3/w2`, Qwen3-MoE:
`mlp.experts.N.gate_proj/up_proj/down_proj`).

Tensor parallelism: every rank holds a slice of every expert's MLP columns (ShardLayout.expert_intermediate):
w13 column-parallel, w2 row-parallel, one all-reduce after the block, as for a dense MLP. Routing is the same
on every rank (replicated router, same input), so no tokens move between ranks.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

from sgnb.engine.model_config import ModelConfig
from sgnb.engine.models.llama import MLP, DecoderLayer, LlamaForCausalLM
from sgnb.engine.tensor_parallel import TPGroup
from sgnb.kernels.moe import fused_moe, select_experts

# model_type -> (the HF module of the expert block, expert tensor names for gate, up, down)
_HF_LAYOUT = {"mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
              "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj"))}
_EXPERT = re.compile(r"\.experts\.\d+\.(\w+)\.weight$")


class SparseMoE(nn.Module):
    """Top-k routed SwiGLU experts: (T, hidden) -> (T, hidden), summed over ranks."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        assert cfg.moe is not None
        self.tp = tp
        self.top_k, self.renormalize = cfg.moe.top_k, cfg.moe.norm_topk_prob
        E, H, inter = cfg.moe.num_experts, cfg.hidden_size, tp.layout.expert_intermediate_size
        self.gate = nn.Linear(H, E, bias=False)  # the router
        self.w13 = nn.Parameter(torch.empty(E, 2 * inter, H))
        self.w2 = nn.Parameter(torch.empty(E, H, inter))
        # the experts' kernel: kernels/moe.py's dispatcher (Triton on CUDA, the torch reference elsewhere); tests
        # set the Triton wrapper to run it in the interpreter on CPU
        self.kernel: Callable[..., torch.Tensor] = fused_moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(self.gate(x), self.top_k, self.renormalize)  # (T, k) each
        return self.tp.all_reduce(self.kernel(x, self.w13, self.w2, weights, ids))  # (T, hidden)


class MoEDecoderLayer(DecoderLayer):
    def make_mlp(self, cfg: ModelConfig, layer_id: int, tp: TPGroup) -> nn.Module:
        assert cfg.moe is not None
        return SparseMoE(cfg, tp) if layer_id in cfg.moe.sparse_layers else MLP(cfg, tp)


class MoEForCausalLM(LlamaForCausalLM):
    layer_cls = MoEDecoderLayer

    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TPGroup | None = None) -> None:
        assert cfg.moe is not None and cfg.architecture in _HF_LAYOUT, cfg.architecture
        super().__init__(cfg, max_positions, tp)
        self.fused_decode = False  # the CPU one-call forward knows dense MLPs only

    # ---- weights ---------------------------------------------------------------------------------------------
    def shard_hf(self, name: str, tensor: Any) -> torch.Tensor:
        """As LlamaForCausalLM's, plus the experts: HF's per-expert tensors and our stacked w13 / w2 (whole
        tensors drawn by init_dummy_weights), each split along its expert-MLP columns."""
        if self.tp.size == 1:
            return tensor[:] if not isinstance(tensor, torch.Tensor) else tensor
        start, end = self.tp.layout.expert_intermediate
        gate, up, down = _HF_LAYOUT[self.config.architecture][1]
        m = _EXPERT.search(name)
        if m and m.group(1) in (gate, up):
            return tensor[start:end]
        if m and m.group(1) == down:
            return tensor[:, start:end]
        if name.endswith(".mlp.w13"):  # (E, 2I, H): the slice of each half
            E, two_i, H = tensor.shape
            halves = tensor.view(E, 2, two_i // 2, H)[:, :, start:end]
            return halves.reshape(E, 2 * (end - start), H)
        if name.endswith(".mlp.w2"):
            return tensor[:, :, start:end]
        return super().shard_hf(name, tensor)

    def adopt_special(self, state: dict[str, torch.Tensor], device: torch.device,
                      dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Each sparse layer's router and stacked experts, from HF's per-expert tensors (popped)."""
        cfg = self.config
        assert cfg.moe is not None
        block, (gate, up, down) = _HF_LAYOUT[cfg.architecture]
        ours: dict[str, torch.Tensor] = {}
        for i in cfg.moe.sparse_layers:
            hf, mine = f"model.layers.{i}.{block}", cast(SparseMoE, self.model.layers[i].mlp)  # a sparse layer
            names = [f"{hf}.gate.weight"] + [f"{hf}.experts.{e}.{w}.weight" for e in range(cfg.moe.num_experts)
                                             for w in (gate, up, down)]
            missing = [n for n in names if n not in state]
            if missing:
                raise ValueError(f"checkpoint lacks {len(missing)} expert tensors, e.g. {missing[:3]}")

            def take(n: str, shape: tuple[int, ...]) -> torch.Tensor:
                t = state.pop(n)
                if tuple(t.shape) != shape:
                    raise ValueError(f"{n}: checkpoint shape {tuple(t.shape)} != model {shape}")
                return t.to(device=device, dtype=dtype)

            E, two_i, H = mine.w13.shape
            ours[f"model.layers.{i}.mlp.gate.weight"] = take(f"{hf}.gate.weight", tuple(mine.gate.weight.shape))
            ours[f"model.layers.{i}.mlp.w13"] = torch.stack([
                torch.cat([take(f"{hf}.experts.{e}.{w}.weight", (two_i // 2, H)) for w in (gate, up)])
                for e in range(E)])  # (E, 2I, H)
            ours[f"model.layers.{i}.mlp.w2"] = torch.stack([
                take(f"{hf}.experts.{e}.{down}.weight", (H, two_i // 2)) for e in range(E)])  # (E, H, I)
        return ours
