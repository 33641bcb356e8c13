"""Our Triton kernels (sgnb.kernels): split-K decode, ragged extend, and a cascade over the shared prefix.

With fb.shared_len = L > 0 the batch's common radix prefix is read once: every query of the batch attends to
the first L slots of one request's row in one non-causal pass, each request then attends to its own keys
[L, seq_len), and the two partials are merged by their log-sum-exps.

A sliding-window layer (`layer.sliding_window` = W) skips the cascade: decode reads positions
[max(0, len - W), len) (the start computed on the device, inside a CUDA graph too), extend masks each query to
its last W positions and skips the tiles before its block's first window.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from sgnb.engine.attention.base import AttentionBackend, AttentionLayer
from sgnb.engine.forward_batch import ForwardBatch, ForwardMode
from sgnb.kernels.decode_attention import decode_attention, default_num_splits
from sgnb.kernels.extend_attention import extend_attention
from sgnb.kernels.merge_state import merge_state

INTERPRETED_PROCESSORS = 4  # what TritonAttention counts for the interpreter (see its _processors)


class _SharedPass(NamedTuple):
    rows: torch.Tensor  # (1,) the row whose first L slots every request shares
    qo_indptr: torch.Tensor  # (2,) [0, T]: all queries as one group
    kv_end: torch.Tensor  # (1,) [L]


class TritonAttention(AttentionBackend):
    name = "triton"
    supports_cuda_graph = True  # decode reads lengths and slots from fb's device tensors only
    supports_extend_graph = True  # extend too, through a block table (fb.blocks)

    @functools.cached_property
    def _processors(self) -> int:
        """The programs the device runs at once: a GPU's multiprocessors. Triton's interpreter (CPU tensors under
        TRITON_INTERPRET=1) runs one program at a time, each a Python loop: split-K gains it nothing and costs a
        program per split (the CPU suite's decode steps ran 27-32 splits a request), so it counts a few, which
        still splits the decode of one to three requests (the tests go through the reduce and its lse)."""
        device = self.kv_cache.k_buffers[0].device
        if device.type == "cuda":
            return torch.cuda.get_device_properties(device).multi_processor_count
        return INTERPRETED_PROCESSORS

    def num_splits(self, batch_size: int) -> int:
        """Decode's key-range splits per request at this batch size (default_num_splits for this device)."""
        return default_num_splits(batch_size, self.num_kv_heads, self._processors)

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        if fb.shared_len == 0:
            fb.attn_metadata = None
            return
        dev = fb.input_ids.device
        qo = fb.qo_indptr[[0, fb.batch_size]]  # (2,) = [0, T], made on the device
        fb.attn_metadata = _SharedPass(fb.req_pool_indices[:1], qo,
                                       torch.full((1,), fb.shared_len, dtype=torch.int64, device=dev))

    def attend_direct(self, q: torch.Tensor, layer: AttentionLayer, fb: ForwardBatch) -> torch.Tensor:
        """Attention of this layer without a cascade and without fb.attn_metadata (any backend's plan may be
        there): what sliding-window layers take, here and in the FlashInfer backends. CUDA-graph safe."""
        k_buf, v_buf = self.kv_cache.k_buffers[layer.layer_id], self.kv_cache.v_buffers[layer.layer_id]
        window = getattr(layer, "sliding_window", None)
        if fb.mode is ForwardMode.DECODE:
            # (B,) first position in the window, a device op: captured with the graph
            start = 0 if window is None else (fb.seq_lens - window).clamp_(min=0)
            return decode_attention(q, k_buf, v_buf, fb.req_to_token, fb.req_pool_indices, start, fb.seq_lens,
                                    layer.scale, num_splits=self.num_splits(fb.batch_size))
        return extend_attention(q, k_buf, v_buf, fb.req_to_token, fb.req_pool_indices, fb.qo_indptr, 0, fb.seq_lens,
                                True, layer.scale, fb.max_extend_len, blocks=fb.blocks, window=window)

    def attend(self, q: torch.Tensor, layer: AttentionLayer, fb: ForwardBatch) -> torch.Tensor:
        k_buf, v_buf = self.kv_cache.k_buffers[layer.layer_id], self.kv_cache.v_buffers[layer.layer_id]
        decode = fb.mode is ForwardMode.DECODE
        splits = self.num_splits(fb.batch_size)  # fixed per batch size (CUDA graphs)
        if getattr(layer, "sliding_window", None) is not None:
            return self.attend_direct(q, layer, fb)
        shared: _SharedPass | None = fb.attn_metadata
        if shared is None:
            if decode:
                return decode_attention(q, k_buf, v_buf, fb.req_to_token, fb.req_pool_indices, 0, fb.seq_lens,
                                        layer.scale, num_splits=splits)
            return extend_attention(q, k_buf, v_buf, fb.req_to_token, fb.req_pool_indices, fb.qo_indptr, 0,
                                    fb.seq_lens, True, layer.scale, fb.max_extend_len, blocks=fb.blocks)
        T, H = q.shape[0], q.shape[1]
        lse1 = torch.empty(T, H, dtype=torch.float32, device=q.device)
        lse2 = torch.empty_like(lse1)
        o1 = extend_attention(q, k_buf, v_buf, fb.req_to_token, shared.rows, shared.qo_indptr, 0, shared.kv_end,
                              False, layer.scale, T, lse=lse1)  # (T, H, D) over the shared prefix
        if decode:
            o2 = decode_attention(q, k_buf, v_buf, fb.req_to_token, fb.req_pool_indices, fb.shared_len,
                                  fb.seq_lens, layer.scale, lse=lse2, num_splits=splits)
        else:
            o2 = extend_attention(q, k_buf, v_buf, fb.req_to_token, fb.req_pool_indices, fb.qo_indptr,
                                  fb.shared_len, fb.seq_lens, True, layer.scale, fb.max_extend_len, lse=lse2)
        return merge_state(o1, lse1, o2, lse2, out=o1)
