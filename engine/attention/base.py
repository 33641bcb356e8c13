"""The attention backend contract, and how one is chosen.

A backend belongs to one runner (or tensor-parallel worker) and one KVCache. Per forward:

    backend.init_forward_metadata(fb)      # once: index tensors, kernel plans (never per layer)
    o = backend.forward(q, k, v, layer, fb) # per layer: store the new K/V at fb.out_cache_loc, then attend
    o = backend.forward(q, k, v, layer, fb, rope=(positions, cos, sin))  # RoPE on q, k first (Llama's layers)

q (T, H, D), k and v (T, Hkv, D) are this rank's heads for the batch's new tokens (k and v may be strided views
of a fused qkv output); the result is (T, H, D) in q's dtype. Request i's queries attend causally to the keys
at req_to_token[req_pool_indices[i], :seq_lens[i]] (the new tokens are the last extend_lens[i] of them). With
fb.shared_len > 0 the first shared_len slots of every request are identical and a backend may read them once for
the whole batch (cascade). `forward` must not read the device (no syncs): everything it needs on the host is in
the ForwardBatch's *_cpu fields and in what init_forward_metadata computed.

CUDA graphs (engine/cuda_graph.py) capture decode forwards over static ForwardBatches, one per batch size, and
replay them. A backend that can run inside a graph sets `supports_cuda_graph` and gets three hooks:
`init_cuda_graph_state(max_bs, max_kv_tokens)` once (static buffers), `init_capture_metadata(fb)` before a batch
size's capture and `init_replay_metadata(fb)` before each replay, both outside the graph (a replay's fb holds
the same tensors as the captured one, refilled in place; its *_cpu fields are current). The default hooks run
`init_forward_metadata`, which suits a backend whose kernels read everything from fb's device tensors (triton).
The torch reference reads host lengths inside `forward` and never runs inside a graph.
Small extends (prefill chunks, mixed batches) replay graphs captured per token budget; a backend that sets
`supports_extend_graph` attends from fb's device tensors with the fixed-grid block table `fb.blocks` (triton,
and hybrid through its Triton half).
"""

from __future__ import annotations

import importlib.util
import logging
import os
from typing import TYPE_CHECKING, Protocol

import torch

from sgnb.engine.config import ATTENTION_BACKENDS

if TYPE_CHECKING:
    from sgnb.engine.forward_batch import ForwardBatch
    from sgnb.engine.kv_pool import KVCache

log = logging.getLogger("sgnb.engine")



class AttentionLayer(Protocol):
    """What a backend needs to know about the layer calling it. A layer may also carry `sliding_window`
    (int W, or None: full attention): its queries then see only their last W positions (own included), the
    convention of transformers' sliding-window masks. The pool still holds every key; only the reads narrow."""

    layer_id: int
    scale: float


class AttentionBackend:
    """Base class: stores K/V through the cache; subclasses implement `init_forward_metadata` and `attend`."""

    name = "base"
    supports_cuda_graph = False
    supports_extend_graph = False

    def __init__(self, kv_cache: KVCache, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.kv_cache = kv_cache
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        """Build what every layer of this forward shares (index tensors, plans) into fb.attn_metadata."""

    def init_cuda_graph_state(self, max_bs: int, max_kv_tokens: int) -> None:
        """Static buffers for graphs of up to max_bs requests over up to max_kv_tokens keys in all."""

    def init_capture_metadata(self, fb: ForwardBatch) -> None:
        """fb.attn_metadata for capturing a decode graph at fb.batch_size (outside the graph)."""
        self.init_forward_metadata(fb)

    def init_replay_metadata(self, fb: ForwardBatch) -> None:
        """Refresh what the captured graph of fb.batch_size reads, for fb's current contents (outside it)."""
        self.init_forward_metadata(fb)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer,
                fb: ForwardBatch, rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                ) -> torch.Tensor:
        """Store the new tokens' k and v in the pool, then attend. rope = (positions, cos, sin): rotate q and k
        first (in place; on CUDA in the same launch as the store)."""
        if rope is None:
            self.kv_cache.store(layer.layer_id, fb.out_cache_loc, k, v)
        else:
            self.kv_cache.store_rope(layer.layer_id, fb.out_cache_loc, q, k, v, *rope)
        return self.attend(q, layer, fb)

    def attend(self, q: torch.Tensor, layer: AttentionLayer, fb: ForwardBatch) -> torch.Tensor:
        raise NotImplementedError


def flashinfer_available() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def resolve_backend_name(name: str, device: torch.device) -> str:
    """The backend `name` stands for on `device` ("auto" resolved); ValueError when it cannot run there."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    cuda = device.type == "cuda"
    if name == "auto":
        if not cuda:
            return "torch"
        return "hybrid" if flashinfer_available() else "triton"
    if name in ("flashinfer", "hybrid"):
        if not cuda:
            raise ValueError(f"attention_backend={name!r} needs a CUDA device")
        if not flashinfer_available():
            raise ValueError(f"attention_backend={name!r} needs FlashInfer: pip install 'sgnb[flashinfer]'")
    if name == "triton" and not cuda:
        if not triton_interpreting():
            raise ValueError("attention_backend='triton' needs a CUDA device (or TRITON_INTERPRET=1, for tests)")
        if importlib.util.find_spec("triton") is None:
            raise ValueError("attention_backend='triton' needs the triton package")
    return name


def make_attention_backend(name: str, kv_cache: KVCache, num_heads: int, num_kv_heads: int, head_dim: int,
                           device: torch.device) -> AttentionBackend:
    """The backend `name` ("auto" resolved by resolve_backend_name) over `kv_cache`, for these heads."""
    resolved = resolve_backend_name(name, device)
    cls: type[AttentionBackend]
    if resolved == "torch":
        from sgnb.engine.attention.torch_backend import TorchAttention as cls
    elif resolved == "triton":
        from sgnb.engine.attention.triton_backend import TritonAttention as cls
    elif resolved == "flashinfer":
        from sgnb.engine.attention.flashinfer_backend import FlashInferAttention as cls
    else:
        from sgnb.engine.attention.hybrid_backend import HybridAttention as cls
    backend = cls(kv_cache, num_heads, num_kv_heads, head_dim)
    log.info("attention backend: %s (asked for %s, on %s)", resolved, name, device)
    return backend
