"""The torch reference backend: the CPU path, and the oracle the fast backends are tested against.

Decode without a batch-wide shared prefix takes a faster route on the CPU: a request's KV slots are mostly one
contiguous run (a prompt is allocated in one piece, and a lone request's decode slots follow it), and attending
to a view of that run reads the pool in place instead of gathering a copy (`index_select` was the largest
non-GEMM cost of a CPU decode step: ~4.8 of ~25 ms at a 1k context). The head run is read as a view, the rest
of the slots (if any) gathered, and the two partials merged by log-sum-exp.
"""

from __future__ import annotations

import torch

from sgnb.engine.attention.base import AttentionBackend, AttentionLayer
from sgnb.engine.forward_batch import ForwardBatch, ForwardMode
from sgnb.kernels.attention import attend_with_lse, merge_partials, paged_attention_ref

MIN_VIEW_RUN = 64  # a contiguous head run shorter than this is gathered with the rest


class TorchAttention(AttentionBackend):
    """Per-request SDPA over gathered K/V (cascade over the shared prefix when fb.shared_len > 0)."""

    name = "torch"

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        fb.attn_metadata = None
        if fb.mode is not ForwardMode.DECODE or fb.shared_len or fb.input_ids.device.type != "cpu":
            return
        runs = []  # per request: (first slot of its contiguous head run, run length, slots of the rest)
        for row, n in zip(fb.req_pool_indices_cpu, fb.seq_lens_cpu):
            slots = fb.req_to_token[row, :n]
            breaks = (slots[1:] - slots[:-1] != 1).nonzero()
            head = int(breaks[0]) + 1 if len(breaks) else n
            if head < MIN_VIEW_RUN:
                return  # not worth it for this batch: the reference path
            runs.append((int(slots[0]), head, slots[head:]))
        fb.attn_metadata = runs

    def attend(self, q: torch.Tensor, layer: AttentionLayer, fb: ForwardBatch) -> torch.Tensor:
        cache = self.kv_cache
        k_buf, v_buf = cache.k_buffers[layer.layer_id], cache.v_buffers[layer.layer_id]
        if fb.attn_metadata is None:
            return paged_attention_ref(q, k_buf, v_buf, fb.req_to_token, fb.req_pool_indices_cpu,
                                       fb.prefix_lens_cpu, fb.extend_lens_cpu, layer.scale, fb.shared_len)
        B, H, D = q.shape
        Hkv = k_buf.shape[1]
        out = torch.empty_like(q)
        for i, (start, head, rest) in enumerate(fb.attn_metadata):
            qi = q[i].view(Hkv, H // Hkv, 1, D)  # (Hkv, G, 1, D): the G query heads of a KV head as rows
            k = k_buf[start: start + head].transpose(0, 1)  # (Hkv, head, D), a view of the pool
            v = v_buf[start: start + head].transpose(0, 1)
            o, lse = attend_with_lse(qi, k, v, layer.scale, None)  # (Hkv, G, 1, D), (Hkv, G, 1)
            if len(rest):
                o2, lse2 = attend_with_lse(qi, k_buf[rest].transpose(0, 1), v_buf[rest].transpose(0, 1),
                                           layer.scale, None)
                o = merge_partials(o, lse, o2, lse2)
            out[i] = o.reshape(H, D)
        return out
