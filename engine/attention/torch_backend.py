"""The torch reference backend: the CPU path, and the oracle the fast backends are tested against.

Groups: the scheduler orders a batch so that requests sharing a cached radix prefix sit together and says so in
fb.groups; each group with a shared prefix runs the reference's cascade on its own (the prefix's K/V read once
for the group), so a batch mixing several few-shot prefixes (MMLU subjects) still reads each prefix once.

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
    """Per-request SDPA over gathered K/V; a cascade per group of requests that share a radix prefix (fb.groups,
    or the batch-wide fb.shared_len); lone decode requests read a contiguous run of the pool in place."""

    name = "torch"

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        offsets = [0]
        for n in fb.extend_lens_cpu:
            offsets.append(offsets[-1] + n)
        views: dict[int, tuple[int, int, torch.Tensor]] = {}
        if fb.mode is ForwardMode.DECODE and fb.input_ids.device.type == "cpu" and not fb.shared_len:
            alone = range(fb.batch_size) if fb.groups is None else [a for a, n, s in fb.groups if n == 1]
            for i in alone:  # (first slot of the contiguous head run, its length, slots of the rest)
                slots = fb.req_to_token[fb.req_pool_indices_cpu[i], : fb.seq_lens_cpu[i]]
                breaks = (slots[1:] - slots[:-1] != 1).nonzero()
                head = int(breaks[0]) + 1 if len(breaks) else len(slots)
                if head >= MIN_VIEW_RUN:
                    views[i] = (int(slots[0]), head, slots[head:])
        fb.attn_metadata = (offsets, views)

    def attend(self, q: torch.Tensor, layer: AttentionLayer, fb: ForwardBatch) -> torch.Tensor:
        cache = self.kv_cache
        k_buf, v_buf = cache.k_buffers[layer.layer_id], cache.v_buffers[layer.layer_id]
        offsets, views = fb.attn_metadata
        if fb.groups is None and not views:
            return paged_attention_ref(q, k_buf, v_buf, fb.req_to_token, fb.req_pool_indices_cpu,
                                       fb.prefix_lens_cpu, fb.extend_lens_cpu, layer.scale, fb.shared_len)
        groups = fb.groups or [(i, 1, 0) for i in range(fb.batch_size)]
        out = torch.empty_like(q)
        for a, n, shared in groups:
            t0, t1 = offsets[a], offsets[a + n]
            if n == 1 and a in views:
                out[t0] = self._decode_view(q[t0], k_buf, v_buf, *views[a], layer.scale)
            else:
                out[t0:t1] = paged_attention_ref(
                    q[t0:t1], k_buf, v_buf, fb.req_to_token, fb.req_pool_indices_cpu[a: a + n],
                    fb.prefix_lens_cpu[a: a + n], fb.extend_lens_cpu[a: a + n], layer.scale, shared)
        return out

    @staticmethod
    def _decode_view(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, start: int, head: int,
                     rest: torch.Tensor, scale: float) -> torch.Tensor:
        """One decode query (H, D) over the view k_buf[start: start + head] and the gathered `rest` slots."""
        H, D = q.shape
        Hkv = k_buf.shape[1]
        qi = q.view(Hkv, H // Hkv, 1, D)  # (Hkv, G, 1, D): the G query heads of a KV head as rows
        k = k_buf[start: start + head].transpose(0, 1)  # (Hkv, head, D), a view of the pool
        v = v_buf[start: start + head].transpose(0, 1)
        o, lse = attend_with_lse(qi, k, v, scale, None)  # (Hkv, G, 1, D), (Hkv, G, 1)
        if len(rest):
            o2, lse2 = attend_with_lse(qi, k_buf[rest].transpose(0, 1), v_buf[rest].transpose(0, 1), scale, None)
            o = merge_partials(o, lse, o2, lse2)
        return o.reshape(H, D)
