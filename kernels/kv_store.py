"""Writing a batch's new K and V into the paged KV pool: one Triton launch for both, and the torch reference."""

from __future__ import annotations

import torch

from ._triton_utils import jit, next_pow2, tl, use_triton


def store_kv_ref(k_buf: torch.Tensor, v_buf: torch.Tensor, loc: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> None:
    """k_buf[loc] = k, v_buf[loc] = v, cast to the buffers' dtype, in place."""
    k_buf[loc] = k.to(k_buf.dtype)
    v_buf[loc] = v.to(v_buf.dtype)


@jit
def _store_kv_kernel(k_buf_ptr, v_buf_ptr, loc_ptr, k_ptr, v_ptr,
                     kb_stride_s, kb_stride_h, vb_stride_s, vb_stride_h,
                     k_stride_t, k_stride_h, v_stride_t, v_stride_h, HKV, D,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    # one program per token: its (Hkv, D) tile of K and of V go to the same slot
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(loc_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < HKV) & (d < D)  # (BLOCK_H, BLOCK_D)
    k = tl.load(k_ptr + t * k_stride_t + h * k_stride_h + d, mask=mask)
    v = tl.load(v_ptr + t * v_stride_t + h * v_stride_h + d, mask=mask)
    tl.store(k_buf_ptr + slot * kb_stride_s + h * kb_stride_h + d, k.to(k_buf_ptr.dtype.element_ty), mask=mask)
    tl.store(v_buf_ptr + slot * vb_stride_s + h * vb_stride_h + d, v.to(v_buf_ptr.dtype.element_ty), mask=mask)


def _store_kv_triton(k_buf: torch.Tensor, v_buf: torch.Tensor, loc: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor) -> None:
    assert k.dim() == 3 and k.shape == v.shape, (k.shape, v.shape)
    T, Hkv, D = k.shape
    assert k_buf.dim() == 3 and k_buf.shape[1:] == (Hkv, D) and v_buf.shape == k_buf.shape, (
        k_buf.shape, v_buf.shape, k.shape)
    assert k.stride(2) == v.stride(2) == k_buf.stride(2) == v_buf.stride(2) == 1, "head dim must be contiguous"
    assert loc.shape == (T,) and not loc.is_floating_point() and loc.stride(0) == 1, (loc.shape, loc.dtype)
    assert k_buf.device == v_buf.device == loc.device == k.device == v.device
    if T == 0:
        return
    BLOCK_H, BLOCK_D = next_pow2(Hkv), next_pow2(D)
    _store_kv_kernel[(T,)](k_buf, v_buf, loc, k, v, k_buf.stride(0), k_buf.stride(1), v_buf.stride(0),
                           v_buf.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), Hkv, D,
                           BLOCK_H=BLOCK_H, BLOCK_D=BLOCK_D, num_warps=min(max(BLOCK_H * BLOCK_D // 1024, 1), 4))


def store_kv(k_buf: torch.Tensor, v_buf: torch.Tensor, loc: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """Write token t's K and V to slot loc[t] of the pool, IN PLACE on k_buf and v_buf (S, Hkv, D).

    k, v (T, Hkv, D) may be strided views (e.g. of a fused qkv output) with a contiguous last dim; they are cast
    to the buffers' dtype. loc (T,) int: distinct slots < S (not checked: that would sync the GPU; duplicate
    slots get one of the writes). Other slots are untouched. Triton on CUDA (one launch), store_kv_ref on CPU.
    """
    if use_triton(k_buf):
        _store_kv_triton(k_buf, v_buf, loc, k, v)
    else:
        store_kv_ref(k_buf, v_buf, loc, k, v)
