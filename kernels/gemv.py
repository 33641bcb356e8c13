"""Skinny matmul for decode: y = x @ w.T (+ bias) for a few rows of x (M <= 8), w an nn.Linear weight (N, K).

At batch 1-8 a decode step's linears read every weight once and do almost no arithmetic: the step is bound by
HBM bandwidth, and what counts is how close the kernel streams w to the device's read rate. Each program owns
BLOCK_N output columns, walks K in BLOCK_K slices (each a contiguous, coalesced read of BLOCK_N weight rows),
keeps the products of the slice in a (M, BLOCK_N, BLOCK_K) fp32 accumulator and reduces it over K once at the end.
With SPLIT_K > 1 (wide K, few columns: too few programs to fill the device) each program takes one K range and
adds into an fp32 output with atomics; the caller casts it.

`gemv(x, w, bias)` runs the Triton kernel on CUDA tensors (or under TRITON_INTERPRET=1), else `gemv_ref`.

Not used by the engine: measured on the H200 (2026-12-02, benchmarks/results/2026-12-02-gpu-gemv.json) it matches
cuBLAS at one row on the 7B linears (3.2-3.9 TB/s, 75-92% of the copy rate) and loses at four, and made the
engine's decode step slower. Kept with benchmarks/gpu/gemv_sweep.py as the baseline for the next attempt.
"""

from __future__ import annotations

import torch

from ._triton_utils import HAS_TRITON, INTERPRET, cdiv, jit, next_pow2, tl

MAX_ROWS = 8


@jit
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_xm, stride_wn, stride_ym,
    M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    k_per = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K  # this program's K range, whole slices
    k_lo = pid_k * k_per
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn  # (BN, 1)
    x_rows = x_ptr + offs_m[:, None] * stride_xm  # (BM, 1)
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(k_lo, tl.minimum(k_lo + k_per, K), BLOCK_K):
        ks = k0 + offs_k
        if EVEN_K:
            w = tl.load(w_rows + ks[None, :], mask=n_mask[:, None], other=0.0)  # (BN, BK)
            x = tl.load(x_rows + ks[None, :], mask=m_mask[:, None], other=0.0)  # (BM, BK)
        else:
            k_mask = ks < K
            w = tl.load(w_rows + ks[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            x = tl.load(x_rows + ks[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    y = tl.sum(acc, axis=2)  # (BM, BN)
    if HAS_BIAS:
        if pid_k == 0:
            y += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        tl.store(out, y.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(out, y, mask=mask, sem="relaxed")


def gemv_config(M: int, N: int, K: int, sm_count: int = 132) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages) for an (M, K) x (K, N) product."""
    block_m = next_pow2(max(M, 1))
    block_k = 512 if block_m == 1 else 256 if block_m <= 2 else 128
    block_n = 16 if block_m <= 2 else 8
    programs = cdiv(N, block_n)
    split_k = 1
    while programs * split_k < 2 * sm_count and K // (split_k * 2) >= 4 * block_k:
        split_k *= 2
    return block_n, block_k, split_k, 4, 3


def gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
         config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """x (M, K), w (N, K), bias (N,) or None -> (M, N) in x.dtype. M <= MAX_ROWS on the Triton path."""
    assert x.dim() == 2 and w.dim() == 2 and x.shape[1] == w.shape[1], (x.shape, w.shape)
    M, K = x.shape
    N = w.shape[0]
    if not (HAS_TRITON and (x.is_cuda or INTERPRET)) or M > MAX_ROWS or M == 0:
        return gemv_ref(x, w, bias)
    assert w.stride(1) == 1 and x.stride(1) == 1, "rows of x and w must be contiguous"
    block_n, block_k, split_k, num_warps, num_stages = config or gemv_config(M, N, K)
    y = (torch.zeros if split_k > 1 else torch.empty)((M, N), dtype=torch.float32 if split_k > 1 else x.dtype,
                                                      device=x.device)
    grid = (cdiv(N, block_n), split_k)
    _gemv_kernel[grid](
        x, w, bias if bias is not None else w, y, N, K, x.stride(0), w.stride(0), y.stride(0),
        M=M, BLOCK_M=next_pow2(M), BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, HAS_BIAS=bias is not None,
        EVEN_K=K % (block_k * split_k) == 0, num_warps=num_warps, num_stages=num_stages)
    return y if split_k == 1 else y.to(x.dtype)


def gemv_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """torch's linear, the reference."""
    return torch.nn.functional.linear(x, w, bias)
