"""FlashInfer (optional: `pip install 'sgnb[flashinfer]'`) over our page-size-1 pool.

The pool's (S, Hkv, D) buffers are FlashInfer's NHD layout with page_size 1 (each slot a page, every last page
full). Per forward, init_forward_metadata builds the flat KV index list on the device from req_to_token and plans
one wrapper with host-side indptrs (no device reads): batch decode (tensor cores when a KV head has > 4 query
heads), batch prefill over the paged cache (causal, bottom-right aligned: new tokens last), or a two-level cascade
when the batch shares a radix prefix (level 0: every query over the shared slots; level 1: each request's own).
CUDA graphs: one decode wrapper per captured batch size in FlashInfer's graph mode, over shared static indptr /
indices / last-page buffers; each replay re-plans it (host indptr, indices written on the device).

Plans are per forward, not per layer: layers FlashInfer's plan does not fit, sliding-window layers and layers
whose softmax scale is not head_dim ** -0.5 (Gemma 3's query_pre_attn_scalar), run our Triton kernels over the
same pool (`TritonAttention.attend_direct`, graph-safe) instead of planning a second set of wrappers.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from sgnb.engine.attention.base import AttentionBackend, AttentionLayer
from sgnb.engine.forward_batch import ForwardBatch, ForwardMode
from sgnb.engine.kv_pool import KVCache

# FlashInfer's float workspace holds the split-KV partial outputs of a plan (fp32, per query row and head), so
# big prefill batches need a big one (a smaller one is suspected of an illegal memory access: NOTES.md); 384 MiB
# is what SGLang allocates
WORKSPACE_BYTES = 384 << 20


def kv_indices(req_to_token: torch.Tensor, rows: torch.Tensor, start: int, ends: torch.Tensor,
               total: int) -> torch.Tensor:
    """Flat int32 slots req_to_token[rows[i], start:ends[i]] for every i, concatenated; `total` (host) is
    sum(ends - start). Device ops only (no sync)."""
    lens = ends - start  # (B,)
    seg = torch.repeat_interleave(torch.arange(len(rows), device=rows.device), lens, output_size=total)  # (N,)
    first = torch.cumsum(lens, 0) - lens  # (B,) where each request's run begins
    cols = torch.arange(total, device=rows.device) - first[seg] + start  # (N,)
    return req_to_token[rows[seg], cols].to(torch.int32)


def _indptr(lens: list[int]) -> torch.Tensor:
    out = np.zeros(len(lens) + 1, dtype=np.int32)
    np.cumsum(lens, out=out[1:])
    return torch.from_numpy(out)


class FlashInferAttention(AttentionBackend):
    name = "flashinfer"
    supports_cuda_graph = True

    def __init__(self, kv_cache: KVCache, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__(kv_cache, num_heads, num_kv_heads, head_dim)
        import flashinfer

        dev = kv_cache.k_buffers[0].device
        self.dtype = kv_cache.k_buffers[0].dtype
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=num_heads // num_kv_heads > 4)
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.cascade = flashinfer.MultiLevelCascadeAttentionWrapper(2, self.workspace, "NHD")
        # (S, Hkv, D) -> (S, 1, Hkv, D): one slot per page
        self.paged = [(k.unsqueeze(1), v.unsqueeze(1)) for k, v in zip(kv_cache.k_buffers, kv_cache.v_buffers)]
        self.use_tensor_cores = num_heads // num_kv_heads > 4
        self.graph_wrappers: dict[int, Any] = {}  # batch size -> decode wrapper in CUDA-graph mode
        from sgnb.engine.attention.triton_backend import TritonAttention

        self.direct = TritonAttention(kv_cache, num_heads, num_kv_heads, head_dim)  # the layers a plan cannot fit

    def init_cuda_graph_state(self, max_bs: int, max_kv_tokens: int) -> None:
        dev = self.workspace.device
        self.g_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=dev)
        self.g_indices = torch.zeros(max_kv_tokens + max_bs, dtype=torch.int32, device=dev)
        self.g_last_page = torch.ones(max_bs, dtype=torch.int32, device=dev)

    def _plan_graph_decode(self, fb: ForwardBatch) -> None:
        wrapper = self.graph_wrappers[fb.batch_size]
        total = sum(fb.seq_lens_cpu)
        indices = kv_indices(fb.req_to_token, fb.req_pool_indices, 0, fb.seq_lens, total)
        wrapper.plan(_indptr(fb.seq_lens_cpu), indices, torch.ones(fb.batch_size, dtype=torch.int32),
                     self.num_heads, self.num_kv_heads, self.head_dim, 1, q_data_type=self.dtype,
                     kv_data_type=self.dtype)
        fb.attn_metadata = wrapper

    def init_capture_metadata(self, fb: ForwardBatch) -> None:
        import flashinfer

        bs = fb.batch_size
        self.graph_wrappers[bs] = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self.use_tensor_cores,
            paged_kv_indptr_buffer=self.g_indptr[: bs + 1], paged_kv_indices_buffer=self.g_indices,
            paged_kv_last_page_len_buffer=self.g_last_page[:bs])
        self._plan_graph_decode(fb)

    def init_replay_metadata(self, fb: ForwardBatch) -> None:
        self._plan_graph_decode(fb)

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        B, L = fb.batch_size, fb.shared_len
        heads = (self.num_heads, self.num_kv_heads, self.head_dim, 1)  # q heads, kv heads, head dim, page size
        own = [s - L for s in fb.seq_lens_cpu]
        indices = kv_indices(fb.req_to_token, fb.req_pool_indices, L, fb.seq_lens, sum(own))
        ones = torch.ones(B, dtype=torch.int32)
        qo_indptr = _indptr(fb.extend_lens_cpu)
        if L > 0:
            shared = fb.req_to_token[fb.req_pool_indices[0], :L].to(torch.int32)  # (L,)
            self.cascade.plan([torch.tensor([0, fb.num_tokens], dtype=torch.int32), qo_indptr],
                              [torch.tensor([0, L], dtype=torch.int32), _indptr(own)], [shared, indices],
                              [torch.ones(1, dtype=torch.int32), ones], *heads, causal=True,
                              q_data_type=self.dtype, kv_data_type=self.dtype)
            fb.attn_metadata = self.cascade
        elif fb.mode is ForwardMode.DECODE:
            self.decode.plan(_indptr(own), indices, ones, *heads, q_data_type=self.dtype, kv_data_type=self.dtype)
            fb.attn_metadata = self.decode
        else:
            self.prefill.plan(qo_indptr, _indptr(own), indices, ones, *heads, causal=True,
                              q_data_type=self.dtype, kv_data_type=self.dtype)
            fb.attn_metadata = self.prefill

    def attend(self, q: torch.Tensor, layer: AttentionLayer, fb: ForwardBatch) -> torch.Tensor:
        if getattr(layer, "sliding_window", None) is not None or abs(layer.scale * self.head_dim**0.5 - 1) > 1e-6:
            return self.direct.attend_direct(q, layer, fb)
        # softmax scale: FlashInfer's default, head_dim ** -0.5, is the layer's
        return fb.attn_metadata.run(q.contiguous(), self.paged[layer.layer_id])  # (T, H, D)
