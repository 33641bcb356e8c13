"""Attention backends owned by the model runner: they store the new tokens' K/V and attend over the paged pool.

`make_attention_backend(name, ...)` picks one: "torch" (the reference: CPU, and the oracle in tests), "triton"
(our kernels in sgnb.kernels), "flashinfer" (when importable), "hybrid" (FlashInfer prefill, Triton decode).
"auto" = hybrid on CUDA when FlashInfer is importable, else triton on CUDA, torch on CPU. See base.py for the
contract.
"""

from sgnb.engine.attention.base import (
    ATTENTION_BACKENDS,
    AttentionBackend,
    make_attention_backend,
    resolve_backend_name,
)

__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "make_attention_backend", "resolve_backend_name"]
