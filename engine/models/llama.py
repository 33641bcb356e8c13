"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3; Gemma 3 in gemma3.py) over the paged KV pool.

RMSNorm, RoPE (incl. llama3 scaling), grouped-query attention, SwiGLU MLP, optional tied embeddings and q/k/v
bias, optional q/k RMSNorm per head (Qwen3) and a sliding window per layer (Mistral; the attention backend
applies `Attention.sliding_window`). Operates on flat token batches (T tokens from many requests); attention
reads the KV pool.

Variants subclass without copying: a model class names its decoder layer (`layer_cls`), a layer builds its
MLP through `make_mlp` (an MoE block replaces it there) and its attention through `make_attention`.
Parameters use Hugging Face names, except that q/k/v are fused into one `qkv_proj` and gate/up into one
`gate_up_proj` (one wider GEMM each); `load_hf_state_dict` stacks an HF checkpoint's tensors into them.

Tensor parallelism (one definition for every tp size): built with a `TPGroup`, each module holds its rank's
shard (see `SHARDING`): q/k/v and gate/up are column-parallel (whole KV groups per rank, so attention needs no
communication), o_proj and down_proj row-parallel (an all-reduce after each), the embedding and lm_head
vocab-parallel; a fused parameter holds this rank's shard of each of its parts, stacked. With the default
single-rank group every shard is the whole tensor and the collectives are no-ops.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar, cast

import torch
from torch import nn

from sgnb.engine.forward_batch import ForwardBatch
from sgnb.engine.model_config import ModelConfig
from sgnb.engine.tensor_parallel import TPGroup
from sgnb.kernels.activation import silu_and_mul
from sgnb.kernels.norm import fused_add_rms_norm, rms_norm
from sgnb.kernels.rope import rope_cos_sin, rope_inv_freq


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        """norm(x); with a residual: residual += x in place, then (norm(residual), residual)."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return fused_add_rms_norm(x, residual, self.weight, self.eps)


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
# Fused parameters: one wider GEMM instead of several (q/k/v; gate/up), stacked along dim 0 from the HF tensors.
FUSED: dict[str, tuple[str, ...]] = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def shard_of(name: str) -> tuple[int, str] | None:
    """(dim, unit) along which HF tensor `name` is split, or None when every rank holds all of it."""
    parts = name.split(".")
    return SHARDING.get(".".join(parts[-3:])) or SHARDING.get(".".join(parts[-2:]))


def hf_names(name: str) -> list[str]:
    """The HF tensors our parameter `name` is made of, in stacking order (itself when it is not fused)."""
    module, _, leaf = name.rpartition(".")
    for ours, parts in FUSED.items():
        if module.endswith(ours):
            base = module[: -len(ours)]
            return [f"{base}{p}.{leaf}" for p in parts]
    return [name]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TPGroup) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.tp = tp
        # this rank's heads (all of them at tp size 1)
        self.num_heads, self.num_kv_heads, self.head_dim = tp.layout.num_heads, tp.layout.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.scale = cfg.attention_scale
        # the backends read it: attend to the last `sliding_window` keys only (None: all of them)
        self.sliding_window = cfg.window_of(layer_id)
        # which RoPE tables this layer takes (Gemma 3's sliding layers have their own base)
        self.rope_kind = "local" if self.sliding_window is not None and cfg.rope_local_theta is not None else "global"
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm: RMSNorm | None
        self.k_norm: RMSNorm | None
        if cfg.qk_norm:  # over each head's D features, one weight shared by all heads
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ropes: dict[str, tuple[torch.Tensor, torch.Tensor]],
                fb: ForwardBatch) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)  # strided views
        q = q.view(T, self.num_heads, self.head_dim)  # (T, H, D)
        k = k.view(T, self.num_kv_heads, self.head_dim)  # (T, Hkv, D)
        v = v.view(T, self.num_kv_heads, self.head_dim)  # (T, Hkv, D)
        if self.q_norm is not None and self.k_norm is not None:  # new contiguous tensors, before RoPE
            # one row per head (the kernels take rows of one stride: a head of the fused output is not that)
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(T, self.num_heads, self.head_dim)  # (T, H, D)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(T, self.num_kv_heads, self.head_dim)  # (T, Hkv, D)
        assert fb.attn_backend is not None, "the runner attaches its attention backend to the batch"
        # (T, H, D); rotates q and k in place and stores k, v in the pool first
        o = fb.attn_backend.forward(q, k, v, self, fb, rope=(positions, *ropes[self.rope_kind]))
        return self.tp.all_reduce(self.o_proj(o.reshape(T, self.q_size)))  # (T, hidden)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        inter = tp.layout.intermediate_size  # this rank's columns
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, cfg.hidden_size, bias=False)
        self.act = cfg.hidden_act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # (T, 2 * inter)
        if self.act == "silu":
            h = silu_and_mul(gate_up)  # (T, inter)
        else:  # gelu_pytorch_tanh: GeGLU (Gemma)
            gate, up = gate_up.chunk(2, dim=-1)
            h = nn.functional.gelu(gate, approximate="tanh") * up  # (T, inter)
        return self.tp.all_reduce(self.down_proj(h))  # (T, hidden)


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
        self.self_attn = self.make_attention(cfg, layer_id, tp)
        self.mlp = self.make_mlp(cfg, layer_id, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def make_attention(self, cfg: ModelConfig, layer_id: int, tp: TPGroup) -> nn.Module:
        return Attention(cfg, layer_id, tp)

    def make_mlp(self, cfg: ModelConfig, layer_id: int, tp: TPGroup) -> nn.Module:
        """This layer's feed-forward block: (T, hidden) -> (T, hidden), all-reduced under TP. A subclass returns
        a mixture-of-experts block here (for some or all layers)."""
        return MLP(cfg, tp)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                ropes: dict[str, tuple[torch.Tensor, torch.Tensor]],
                fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) -> (this layer's MLP output, the running sum before it). The sums happen inside the
        next norm (fused add + RMSNorm): h = residual + attn(norm(residual)), out = h + mlp(norm(h)).
        ropes: the model's RoPE tables by kind ("global", and "local" where sliding layers have their own)."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, positions, ropes, fb)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, layer_cls: type[DecoderLayer] = DecoderLayer) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg, tp)
        self.layers = nn.ModuleList(layer_cls(cfg, i, tp) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    layer_cls: ClassVar[type[DecoderLayer]] = DecoderLayer  # what a subclass swaps (Gemma 3, an MoE model)
    # added to every norm weight at load (Gemma's norms scale by 1 + w: the model stores 1 + w)
    norm_offset: ClassVar[float] = 0.0

    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp or TPGroup.single(cfg)
        self.model = LlamaModel(cfg, self.tp, self.layer_cls)
        self.lm_head = nn.Linear(cfg.hidden_size, self.tp.layout.vocab_size, bias=False)  # this rank's vocab rows
        self.max_positions = max_positions
        self.tie_weights()
        self.rope_cos: torch.Tensor | None = None  # set by setup_rope once weights are on their device
        self.rope_sin: torch.Tensor | None = None
        self.ropes: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # by kind: "global" (and "local")
        # CPU decode steps run every layer in one call of our C kernel when the weights are on its formats
        # (kernels/native.decode_layers); False: always the module path (tests compare the two)
        self.fused_decode = os.environ.get("SGNB_FUSED_DECODE", "1") != "0"
        self.fused_steps = 0  # forwards that took it (decodes and short extends)
        self.fused_max_tokens = 128  # the most new tokens (rows) a forward takes it with (<= native.MAX_ROWS)
        self._fused_table: tuple[int, torch.Tensor | None, int] | None = None  # (KV pool's address, table, rows)

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def setup_rope(self, device: torch.device) -> None:
        """cos/sin tables (P, D), always float32 and kept out of .to(dtype): bf16 positions would drift."""
        cfg = self.config
        inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling_dict)
        cos, sin = rope_cos_sin(inv_freq, self.max_positions)
        self.rope_cos, self.rope_sin = cos.to(device), sin.to(device)
        self.ropes = {"global": (self.rope_cos, self.rope_sin)}
        if cfg.rope_local_theta is not None:  # sliding layers: their own base, no scaling
            cos, sin = rope_cos_sin(rope_inv_freq(cfg.head_dim, cfg.rope_local_theta, None), self.max_positions)
            self.ropes["local"] = (cos.to(device), sin.to(device))

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Hidden states after the final norm for every new token: (T, hidden). Rows fb.mm_rows take the
        encoder features fb.mm_embeds instead of a token embedding (a multimodal model's image tokens)."""
        assert self.rope_cos is not None and self.rope_sin is not None, "load or init weights first"
        if self.fused_decode and fb.mm_rows is None:
            out = self._fused_decode(fb)
            if out is not None:
                return out
        x = self.embed(fb.input_ids)  # (T, hidden)
        if fb.mm_rows is not None:
            x[fb.mm_rows] = fb.mm_embeds.to(x.dtype)  # type: ignore[union-attr]
        residual = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, fb.positions, self.ropes, fb)
        if residual is None:  # no layers
            return self.model.norm(x)
        return self.model.norm(x, residual)[0]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The input embeddings of token ids (T,) -> (T, hidden)."""
        return self.model.embed_tokens(ids)

    def _native_layers(self) -> bool:
        """Whether our C decode kernel computes this model's layers: plain Llama layers (no q/k norm, SwiGLU,
        full attention everywhere, the standard scale)."""
        cfg = self.config
        return (type(self).layer_cls is DecoderLayer and self.norm_offset == 0.0 and not cfg.qk_norm
                and cfg.hidden_act == "silu" and cfg.sliding_window is None
                and cfg.query_pre_attn_scalar is None and all(type(layer.mlp) is MLP for layer in self.model.layers))

    def _fused_decode(self, fb: ForwardBatch) -> torch.Tensor | None:
        """A decode or short extend forward in one call of our C kernel, one row per new token, or None where it
        does not apply: weights or KV not on its formats, more tokens than it takes, an attention backend
        without our kernel's plan."""
        from sgnb.engine.attention.torch_backend import _NativePlan
        from sgnb.kernels import native

        # the attention backend's plan says our attention kernel runs this batch (a decode, or an extend whose
        # rows read few keys of their own: a fork's prompt, select's choices, the next step of a program); its
        # cascades (a prefix shared by a group, read once) are not taken: each row reads all its keys, which at
        # these sizes costs less than the module path's per-layer Python (forked programs run as such groups)
        plan = fb.attn_metadata
        if not isinstance(plan, _NativePlan) or len(plan.rows) > min(self.fused_max_tokens, native.MAX_ROWS):
            return None
        table, max_rows = self._decode_table(fb)
        if table is None or len(plan.rows) > max_rows:
            return None
        attn = cast(Attention, self.model.layers[0].self_attn)
        assert self.rope_cos is not None and self.rope_sin is not None  # _decode_table found weights on the CPU
        x = self.model.embed_tokens(fb.input_ids).float().contiguous()  # (T, hidden)
        self.fused_steps += 1
        return native.decode_layers(table, x, self.model.norm.weight, self.model.norm.eps, fb.positions,
                                    self.rope_cos, self.rope_sin, fb.out_cache_loc, fb.req_to_token,
                                    plan.rows, plan.starts + plan.lens, attn.num_heads, attn.num_kv_heads,
                                    attn.head_dim, self.tp.layout.intermediate_size, attn.scale)

    def _decode_table(self, fb: ForwardBatch) -> tuple[torch.Tensor | None, int]:
        """decode_layers' table of this model over fb's KV pool (built once per pool), or None when a weight
        or the pool is not on the kernel's formats; and the most rows it takes (float32 weights: up to where
        our GEMV beats torch's GEMM, kernels/dense_linear.py)."""
        from sgnb.kernels import native
        from sgnb.kernels.dense_linear import F32_SMALL_M

        cache = fb.attn_backend.kv_cache if fb.attn_backend is not None else None
        if cache is None or not cache.k_buffers:
            return None, 0
        key = cache.k_buffers[0].data_ptr()
        if self._fused_table is not None and self._fused_table[0] == key:
            return self._fused_table[1], self._fused_table[2]
        table = None
        ok = (self.tp.size == 1 and fb.input_ids.device.type == "cpu" and self._native_layers() and native.available()
              and self.model.norm.weight.dtype == torch.float32
              and all(b.dtype == torch.float32 and b.is_contiguous() for b in (*cache.k_buffers, *cache.v_buffers)))
        rows, kinds = [], set()
        layers = cast("list[DecoderLayer]", list(self.model.layers) if ok else [])
        for i, layer in enumerate(layers):
            a, m = cast(Attention, layer.self_attn), cast(MLP, layer.mlp)  # plain layers: _native_layers
            found = [native.linear_fields(lin) for lin in (a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj)]
            fields = [f for f in found if f is not None]
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            if (len(fields) < len(found) or any(lin.bias is not None for lin in (a.o_proj, m.gate_up_proj, m.down_proj))
                    or any(n.dtype != torch.float32 for n in norms)
                    or layer.input_layernorm.eps != self.model.norm.eps
                    or layer.post_attention_layernorm.eps != self.model.norm.eps):
                break
            bias = a.qkv_proj.bias
            kinds |= {f[0] for f in fields}
            rows.append([norms[0].data_ptr(), norms[1].data_ptr(), *fields[0], 0 if bias is None else bias.data_ptr(),
                         *fields[1], *fields[2], *fields[3], cache.k_buffers[i].data_ptr(),
                         cache.v_buffers[i].data_ptr()])
        if ok and rows and len(rows) == len(self.model.layers):
            table = torch.tensor(rows, dtype=torch.int64)
        max_rows = F32_SMALL_M if kinds & {32, 33} else native.MAX_ROWS  # float32 weights (or their exact codes)
        self._fused_table = (key, table, max_rows)
        return table, max_rows

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """(N, hidden) -> (N, vocab) float32; with tensor parallelism every rank must call it and only rank 0
        gets the logits (the others get None)."""
        return self.tp.gather_vocab(self.lm_head(hidden).float())

    # ---- weights ---------------------------------------------------------------------------------------------
    def fused_sizes(self, name: str, whole: bool = False) -> list[int]:
        """Rows of each HF part of the fused parameter `name` (this rank's, or the whole model's)."""
        cfg = self.config
        if ".qkv_proj." in name:
            if whole:
                return [cfg.q_size, cfg.kv_size, cfg.kv_size]
            layout = self.tp.layout
            return [layout.num_heads * cfg.head_dim] + [layout.num_kv_heads * cfg.head_dim] * 2
        assert ".gate_up_proj." in name, name
        return [cfg.intermediate_size if whole else self.tp.layout.intermediate_size] * 2

    def shard_hf(self, name: str, tensor: Any) -> torch.Tensor:
        """This rank's part of the full HF tensor `name` (a tensor or a safetensors slice, which then reads
        only that part). The whole tensor when the model is not sharded or the tensor is replicated."""
        spec = shard_of(name) if self.tp.size > 1 else None
        if spec is None:
            return tensor[:] if not isinstance(tensor, torch.Tensor) else tensor
        dim, unit = spec
        start, end = self.tp.layout.span(unit, self.config.head_dim)
        return tensor[start:end] if dim == 0 else tensor[:, start:end]

    def shard_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of the whole model's parameter `name` (HF names too): a fused parameter is split
        into its HF parts, each part sharded, and the shards stacked again."""
        parts = hf_names(name)
        if len(parts) == 1:
            return self.shard_hf(name, tensor)
        pieces = tensor.split(self.fused_sizes(name, whole=True))
        return torch.cat([self.shard_hf(p, t) for p, t in zip(parts, pieces)])

    def load_hf_state_dict(self, state: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype) -> None:
        """Adopt HF-named tensors (this rank's shards when sharded: `load_state_dict(source, ...,
        shard=model.shard_hf)`), fusing q/k/v and gate/up. Works on a model built on the meta device: no init,
        and no copy of unfused tensors that already have the right dtype and device. Every parameter must be
        given; lm_head may be tied."""
        tied = self.config.tie_word_embeddings
        state = {n: t for n, t in state.items()
                 if not n.endswith("rotary_emb.inv_freq") and not (n == "lm_head.weight" and tied)}
        ours = self.adopt_special(state, device, dtype)  # parameters not made of 2-D HF tensors (a subclass's)
        own = {n: p for n, p in self.named_parameters() if n not in ours}
        wanted = {hf: name for name in own for hf in hf_names(name)}
        missing = [hf for hf in wanted if hf not in state]
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
        unexpected = [n for n in state if n not in wanted]
        if unexpected:
            raise ValueError(f"checkpoint has an unexpected tensor {unexpected[0]!r}")
        for name, param in own.items():
            parts = hf_names(name)
            sizes = self.fused_sizes(name) if len(parts) > 1 else [param.shape[0]]
            for hf, rows in zip(parts, sizes):
                expected = (rows, *param.shape[1:])
                if tuple(state[hf].shape) != expected:
                    raise ValueError(f"{hf}: checkpoint shape {tuple(state[hf].shape)} != model {expected}")
            if len(parts) == 1:
                ours[name] = state.pop(parts[0]).to(device=device, dtype=dtype)
            else:  # stack, then let the parts go (one layer's worth of extra memory at a time)
                ours[name] = torch.cat([state.pop(hf).to(device=device, dtype=dtype) for hf in parts])
        if self.norm_offset:
            ours = {n: t + self.norm_offset if "norm" in n else t for n, t in ours.items()}
        self.load_state_dict(ours, strict=False, assign=True)
        self.tie_weights()
        self.setup_rope(device)

    def adopt_special(self, state: dict[str, torch.Tensor], device: torch.device,
                      dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Our parameters that load_hf_state_dict's fusing of 2-D HF tensors does not make, by our name, built
        from (and popped out of) `state`. None here; a mixture-of-experts model stacks its experts."""
        return {}

    def init_dummy_weights(self, device: torch.device, dtype: torch.dtype, seed: int = 0) -> None:
        """Random weights of the real shape (for benchmarks), made on the device: small normal, norms at 1.
        Every HF tensor is drawn whole from its own seed, then this rank's shard is kept (and fused parts
        stacked): the model is the same at every tensor-parallel size (so tp outputs can be compared on random
        weights too)."""
        self.to(dtype)  # still on the meta device: the storage is made in `dtype` (not float32 first: a 30B
        self.to_empty(device=device)  # model's float32 copy would not fit an 80 GB card)
        self.tie_weights()
        with torch.device("meta"):
            whole = type(self)(self.config, self.max_positions)
        shapes: dict[str, tuple[int, ...]] = {}
        for name, p in whole.named_parameters():
            parts = hf_names(name)
            sizes = whole.fused_sizes(name, whole=True) if len(parts) > 1 else [p.shape[0]]
            shapes.update((hf, (rows, *p.shape[1:])) for hf, rows in zip(parts, sizes))
        order = {hf: i for i, hf in enumerate(shapes)}
        with torch.no_grad():
            for name, p in self.named_parameters():
                if "norm" in name:
                    p.fill_(1.0)
                    continue
                pieces = []
                for hf in hf_names(name):
                    gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + order[hf])
                    full = torch.empty(shapes[hf], device=device, dtype=dtype).normal_(0.0, 0.02, generator=gen)
                    pieces.append(self.shard_hf(hf, full))
                p.copy_(pieces[0] if len(pieces) == 1 else torch.cat(pieces))
        self.setup_rope(device)
