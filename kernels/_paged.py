"""Boundary checks shared by the paged-attention kernels (metadata only: no device reads)."""

from __future__ import annotations

import torch


def check_pool_args(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, req_to_token: torch.Tensor,
                    req_pool_indices: torch.Tensor, kv_start: int | torch.Tensor,
                    kv_end: torch.Tensor) -> tuple[int, int, int, int]:
    """Queries (N, H, D) over a (S, Hkv, D) K/V pool through req_to_token rows; returns (B, H, Hkv, D)."""
    assert q.dim() == 3 and k_buf.dim() == 3, (q.shape, k_buf.shape)
    _, H, D = q.shape
    _, Hkv, Dk = k_buf.shape
    assert v_buf.shape == k_buf.shape and Dk == D and H % Hkv == 0, (q.shape, k_buf.shape, v_buf.shape)
    assert D >= 16 and D & (D - 1) == 0, f"head_dim {D} must be a power of two >= 16"
    assert q.dtype in (torch.bfloat16, torch.float16, torch.float32), q.dtype
    assert k_buf.dtype == v_buf.dtype == q.dtype, (q.dtype, k_buf.dtype, v_buf.dtype)
    assert q.stride(-1) == 1 and k_buf.stride(-1) == 1 and v_buf.stride(-1) == 1, "last dim must be contiguous"
    assert req_to_token.dim() == 2 and req_to_token.stride(1) == 1, (req_to_token.shape, req_to_token.stride())
    B = req_pool_indices.shape[0]
    assert req_pool_indices.shape == (B,) and kv_end.shape == (B,), (req_pool_indices.shape, kv_end.shape)
    for name, t in (("req_to_token", req_to_token), ("req_pool_indices", req_pool_indices), ("kv_end", kv_end)):
        assert t.dtype in (torch.int32, torch.int64), (name, t.dtype)
        assert t.device == q.device, (name, t.device, q.device)
    if isinstance(kv_start, torch.Tensor):
        assert kv_start.shape == (B,) and kv_start.dtype in (torch.int32, torch.int64), kv_start.shape
        assert kv_start.device == q.device
    else:
        assert int(kv_start) >= 0, kv_start
    assert k_buf.device == v_buf.device == q.device
    return B, H, Hkv, D
