"""Llama-family decoder (Llama 2/3, Mistral, Qwen2-style configs) over the paged KV pool.

RMSNorm, RoPE (incl. llama3 scaling), grouped-query attention, SwiGLU MLP, optional tied embeddings and q/k/v
bias. Operates on flat token batches (T tokens from many requests); attention reads the KV pool.
Weights use Hugging Face tensor names so an HF checkpoint loads as is.

Tensor parallelism (one definition for every tp size): built with a `TPGroup`, each module holds its rank's
shard (see `SHARDING`): q/k/v and gate/up are column-parallel (whole KV groups per rank, so attention needs no
communication), o_proj and down_proj row-parallel (an all-reduce after each), the embedding and lm_head
vocab-parallel. With the default single-rank group every shard is the whole tensor and the collectives are
no-ops.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from sgnb.engine.forward_batch import ForwardBatch
from sgnb.engine.model_config import ModelConfig
from sgnb.engine.tensor_parallel import TPGroup
from sgnb.kernels.attention import paged_attention_ref
from sgnb.kernels.norm import rms_norm_ref
from sgnb.kernels.rope import apply_rope_ref, rope_cos_sin, rope_inv_freq


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_ref(x, self.weight, self.eps)


# How each HF tensor is split across ranks: name suffix -> (dim, unit of ShardLayout). Others are replicated.
SHARDING: dict[str, tuple[int, str]] = {
    "self_attn.q_proj.weight": (0, "heads"), "self_attn.q_proj.bias": (0, "heads"),
    "self_attn.k_proj.weight": (0, "kv_heads"), "self_attn.k_proj.bias": (0, "kv_heads"),
    "self_attn.v_proj.weight": (0, "kv_heads"), "self_attn.v_proj.bias": (0, "kv_heads"),
    "self_attn.o_proj.weight": (1, "heads"),
    "mlp.gate_proj.weight": (0, "intermediate"), "mlp.up_proj.weight": (0, "intermediate"),
    "mlp.down_proj.weight": (1, "intermediate"),
    "model.embed_tokens.weight": (0, "vocab"), "lm_head.weight": (0, "vocab"),
}


def shard_of(name: str) -> tuple[int, str] | None:
    """(dim, unit) along which tensor `name` is split, or None when every rank holds all of it."""
    parts = name.split(".")
    return SHARDING.get(".".join(parts[-3:])) or SHARDING.get(".".join(parts[-2:]))


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TPGroup) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.tp = tp
        # this rank's heads (all of them at tp size 1)
        self.num_heads, self.num_kv_heads, self.head_dim = tp.layout.num_heads, tp.layout.num_kv_heads, cfg.head_dim
        self.scale = self.head_dim**-0.5
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.num_heads, self.head_dim)  # (T, H, D)
        k = self.k_proj(x).view(T, self.num_kv_heads, self.head_dim)  # (T, Hkv, D)
        v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)  # (T, Hkv, D)
        q, k = apply_rope_ref(q, cos, sin), apply_rope_ref(k, cos, sin)
        kv = fb.kv_cache
        assert kv is not None, "the runner attaches its KV storage to the batch"
        k_buf, v_buf = kv.k_buffers[self.layer_id], kv.v_buffers[self.layer_id]
        k_buf[fb.out_cache_loc] = k.to(k_buf.dtype)
        v_buf[fb.out_cache_loc] = v.to(v_buf.dtype)
        o = paged_attention_ref(q, k_buf, v_buf, fb.req_to_token, fb.req_pool_indices, fb.prefix_lens,
                                fb.extend_lens, self.scale, fb.shared_len)  # (T, H, D)
        return self.tp.all_reduce(self.o_proj(o.reshape(T, self.num_heads * self.head_dim)))  # (T, hidden)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        inter = tp.layout.intermediate_size  # this rank's columns
        self.gate_proj = nn.Linear(cfg.hidden_size, inter, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, inter, bias=False)
        self.down_proj = nn.Linear(inter, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x)))


class VocabEmbedding(nn.Module):
    """Token embedding holding this rank's vocabulary rows; other ranks fill in the rest (all-reduce)."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.start, self.end = tp.layout.vocab
        self.weight = nn.Parameter(torch.empty(self.end - self.start, cfg.hidden_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return nn.functional.embedding(ids, self.weight)  # (T, hidden)
        mine = (ids >= self.start) & (ids < self.end)  # (T,)
        x = nn.functional.embedding((ids - self.start) * mine, self.weight) * mine.unsqueeze(1).to(self.weight.dtype)
        return self.tp.all_reduce(x)  # (T, hidden)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TPGroup) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_id, tp)
        self.mlp = MLP(cfg, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, fb)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp or TPGroup.single(cfg)
        self.model = LlamaModel(cfg, self.tp)
        self.lm_head = nn.Linear(cfg.hidden_size, self.tp.layout.vocab_size, bias=False)  # this rank's vocab rows
        self.max_positions = max_positions
        self.tie_weights()
        self.rope_cos: torch.Tensor | None = None  # set by setup_rope once weights are on their device
        self.rope_sin: torch.Tensor | None = None

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def setup_rope(self, device: torch.device) -> None:
        """cos/sin tables (P, D), always float32 and kept out of .to(dtype): bf16 positions would drift."""
        cfg = self.config
        inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling_dict)
        cos, sin = rope_cos_sin(inv_freq, self.max_positions)
        self.rope_cos, self.rope_sin = cos.to(device), sin.to(device)

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Hidden states after the final norm for every new token: (T, hidden)."""
        assert self.rope_cos is not None and self.rope_sin is not None, "load or init weights first"
        x = self.model.embed_tokens(fb.input_ids)  # (T, hidden)
        cos, sin = self.rope_cos[fb.positions], self.rope_sin[fb.positions]  # (T, D)
        for layer in self.model.layers:
            x = layer(x, cos, sin, fb)
        return self.model.norm(x)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """(N, hidden) -> (N, vocab) float32; with tensor parallelism every rank must call it and only rank 0
        gets the logits (the others get None)."""
        return self.tp.gather_vocab(self.lm_head(hidden).float())

    def shard_tensor(self, name: str, tensor: Any) -> torch.Tensor:
        """This rank's part of the full HF tensor `name` (a tensor or a safetensors slice, which then reads
        only that part). The whole tensor when the model is not sharded or the tensor is replicated."""
        spec = shard_of(name) if self.tp.size > 1 else None
        if spec is None:
            return tensor[:] if not isinstance(tensor, torch.Tensor) else tensor
        dim, unit = spec
        start, end = self.tp.layout.span(unit, self.config.head_dim)
        return tensor[start:end] if dim == 0 else tensor[:, start:end]

    def load_hf_state_dict(self, state: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype) -> None:
        """Adopt HF-named tensors (works on a model built on the meta device: no init, no copy when the
        checkpoint already has the right dtype and device). Every parameter must be given; lm_head may be tied.
        A sharded model takes this rank's shards: `load_state_dict(source, ..., shard=model.shard_tensor)`."""
        own = dict(self.named_parameters())
        tied = self.config.tie_word_embeddings
        missing = [n for n in own if n not in state and not (n == "lm_head.weight" and tied)]
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
        ours = {}
        for name, tensor in state.items():
            if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and tied):
                continue
            if name not in own:
                raise ValueError(f"checkpoint has an unexpected tensor {name!r}")
            if own[name].shape != tensor.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(own[name].shape)}")
            ours[name] = tensor.to(device=device, dtype=dtype)
        self.load_state_dict(ours, strict=False, assign=True)
        self.tie_weights()
        self.setup_rope(device)

    def init_dummy_weights(self, device: torch.device, dtype: torch.dtype, seed: int = 0) -> None:
        """Random weights of the real shape (for benchmarks), made on the device: small normal, norms at 1.
        Every tensor is drawn whole from its own seed, then this rank's shard is kept: the model is the same at
        every tensor-parallel size (so tp outputs can be compared on random weights too)."""
        self.to_empty(device=device)
        self.to(dtype)
        self.tie_weights()
        with torch.device("meta"):
            whole = LlamaForCausalLM(self.config, self.max_positions)
        order = {name: i for i, (name, _) in enumerate(whole.named_parameters())}
        shapes = {name: p.shape for name, p in whole.named_parameters()}
        with torch.no_grad():
            for name, p in self.named_parameters():
                if "norm" in name:
                    p.fill_(1.0)
                    continue
                gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + order[name])
                if p.shape == shapes[name]:
                    p.normal_(0.0, 0.02, generator=gen)
                else:
                    full = torch.empty(shapes[name], device=device, dtype=dtype).normal_(0.0, 0.02, generator=gen)
                    p.copy_(self.shard_tensor(name, full))
        self.setup_rope(device)
