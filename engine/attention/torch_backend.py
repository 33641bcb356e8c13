"""The torch reference backend: the CPU path, and the oracle the fast backends are tested against."""

from __future__ import annotations

import torch

from sgnb.engine.attention.base import AttentionBackend, AttentionLayer
from sgnb.engine.forward_batch import ForwardBatch
from sgnb.kernels.attention import paged_attention_ref


class TorchAttention(AttentionBackend):
    """Per-request SDPA over gathered K/V (cascade over the shared prefix when fb.shared_len > 0)."""

    name = "torch"

    def attend(self, q: torch.Tensor, layer: AttentionLayer, fb: ForwardBatch) -> torch.Tensor:
        cache = self.kv_cache
        return paged_attention_ref(q, cache.k_buffers[layer.layer_id], cache.v_buffers[layer.layer_id],
                                   fb.req_to_token, fb.req_pool_indices_cpu, fb.prefix_lens_cpu,
                                   fb.extend_lens_cpu, layer.scale, fb.shared_len)  # (T, H, D)
