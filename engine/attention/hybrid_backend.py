"""FlashInfer for prefill, our Triton kernels for decode: what "auto" takes on CUDA when FlashInfer is there.

FlashInfer's prefill (FA3 on Hopper) is faster than our extend kernel, while inside the decode CUDA graphs our
split-K decode is as fast or faster and needs no per-step host plan (FlashInfer's graph-mode plan costs
milliseconds of host time per decode step; the numbers are in benchmarks/results/NOTES.md). Extend batches (prefill, mixed batches, jump-forward extends, cascades over a shared prefix) go to
FlashInfer; decode batches, eager or in a graph, and the small extends that replay an extend CUDA graph, to
Triton. Both read the same KV pool.
"""

from __future__ import annotations

from sgnb.engine.attention.base import AttentionBackend, AttentionLayer
from sgnb.engine.attention.flashinfer_backend import FlashInferAttention
from sgnb.engine.attention.triton_backend import TritonAttention
from sgnb.engine.forward_batch import ForwardBatch, ForwardMode
from sgnb.engine.kv_pool import KVCache


class HybridAttention(AttentionBackend):
    name = "hybrid"
    supports_cuda_graph = True  # decode graphs run the Triton half
    supports_extend_graph = True  # and extend graphs

    def __init__(self, kv_cache: KVCache, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__(kv_cache, num_heads, num_kv_heads, head_dim)
        self.prefill = FlashInferAttention(kv_cache, num_heads, num_kv_heads, head_dim)
        self.decode = TritonAttention(kv_cache, num_heads, num_kv_heads, head_dim)

    def _half(self, fb: ForwardBatch) -> AttentionBackend:
        # a small extend inside a CUDA graph (fb.blocks) runs on Triton too: FlashInfer plans on the host per batch
        return self.decode if fb.mode is ForwardMode.DECODE or fb.blocks is not None else self.prefill

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        self._half(fb).init_forward_metadata(fb)

    def init_cuda_graph_state(self, max_bs: int, max_kv_tokens: int) -> None:
        self.decode.init_cuda_graph_state(max_bs, max_kv_tokens)

    def init_capture_metadata(self, fb: ForwardBatch) -> None:
        self.decode.init_capture_metadata(fb)

    def init_replay_metadata(self, fb: ForwardBatch) -> None:
        self.decode.init_replay_metadata(fb)

    def attend(self, q, layer: AttentionLayer, fb: ForwardBatch):
        # the FlashInfer half hands sliding-window layers (and other scales) to Triton itself
        return self._half(fb).attend(q, layer, fb)
