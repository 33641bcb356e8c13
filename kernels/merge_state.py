"""Merge two attention partials over disjoint key sets by their log-sum-exps (cascade / split-K attention).

With partials (o1, lse1) over keys K1 and (o2, lse2) over K2 (o normalized, lse = ln sum exp(score)):
lse = ln(e^lse1 + e^lse2) and o = (e^lse1 o1 + e^lse2 o2) / e^lse, computed from max(lse1, lse2) so nothing
overflows. LSE is the natural log everywhere (FlashInfer's merge_state takes base 2). A side with lse = -inf saw
no key: it gets weight 0 and its o is ignored (even NaN); both -inf gives o = 0, lse = -inf.
"""

from __future__ import annotations

import torch

from ._triton_utils import HAS_TRITON, cdiv, constexpr, next_pow2, tl
from ._triton_utils import jit as _jit

MERGE_BLOCK_H = 16  # heads per program (fewer when H is smaller)
MERGE_WARPS = 4

_LOG2E = constexpr(1.4426950408889634)  # log2(e): exp(x) = exp2(x * log2(e))


@_jit
def _merge_kernel(
    o1_ptr, lse1_ptr, o2_ptr, lse2_ptr, out_ptr, lse_out_ptr, H,
    stride_o1t, stride_o1h, stride_l1t, stride_l1h, stride_o2t, stride_o2h, stride_l2t, stride_l2h,
    stride_ot, stride_oh, stride_lot, stride_loh,
    D: tl.constexpr, BLOCK_H: tl.constexpr, WRITE_LSE: tl.constexpr,
):
    """One token, BLOCK_H heads. Reads all its inputs before writing, so out may alias o1 (or o2)."""
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, D)
    head_ok = offs_h < H
    s1 = tl.load(lse1_ptr + t * stride_l1t + offs_h * stride_l1h, mask=head_ok, other=float("-inf"))  # (BLOCK_H,)
    s2 = tl.load(lse2_ptr + t * stride_l2t + offs_h * stride_l2h, mask=head_ok, other=float("-inf"))
    o1 = tl.load(o1_ptr + t * stride_o1t + offs_h[:, None] * stride_o1h + offs_d[None, :], mask=head_ok[:, None],
                 other=0.0).to(tl.float32)  # (BLOCK_H, D)
    o2 = tl.load(o2_ptr + t * stride_o2t + offs_h[:, None] * stride_o2h + offs_d[None, :], mask=head_ok[:, None],
                 other=0.0).to(tl.float32)
    m = tl.maximum(s1, s2)
    m = tl.where(m == float("-inf"), 0.0, m)  # both sides empty: weights exp(-inf) = 0, no NaN
    w1 = tl.exp2((s1 - m) * _LOG2E)
    w2 = tl.exp2((s2 - m) * _LOG2E)
    total = w1 + w2
    seen = total > 0
    o = tl.where(w1[:, None] > 0, w1[:, None] * o1, 0.0) + tl.where(w2[:, None] > 0, w2[:, None] * o2, 0.0)
    o = o / tl.where(seen, total, 1.0)[:, None]
    tl.store(out_ptr + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])
    if WRITE_LSE:
        lse = tl.where(seen, m + tl.log(tl.where(seen, total, 1.0)), float("-inf"))
        tl.store(lse_out_ptr + t * stride_lot + offs_h * stride_loh, lse, mask=head_ok)


INTERPRETED = HAS_TRITON and type(_merge_kernel).__name__ == "InterpretedFunction"
"""Whether the kernel was decorated under TRITON_INTERPRET=1 (then it also runs on CPU tensors)."""


def _use_triton(t: torch.Tensor) -> bool:
    return HAS_TRITON and (t.is_cuda or INTERPRETED)


def _check_args(o1, lse1, o2, lse2, out, lse_out) -> tuple[int, int, int]:
    assert o1.dim() == 3 and o1.shape == o2.shape, (o1.shape, o2.shape)
    N, H, D = o1.shape
    assert D & (D - 1) == 0, f"head_dim {D} must be a power of two"
    assert lse1.shape == lse2.shape == (N, H), (lse1.shape, lse2.shape, (N, H))
    assert lse1.dtype == lse2.dtype == torch.float32, (lse1.dtype, lse2.dtype)
    assert o1.stride(-1) == 1 and o2.stride(-1) == 1, "last dim must be contiguous"
    for t in (o2, lse1, lse2):
        assert t.device == o1.device, (t.device, o1.device)
    if out is not None:
        assert out.shape == o1.shape and out.stride(-1) == 1 and out.device == o1.device, (out.shape, out.stride())
    if lse_out is not None:
        assert lse_out.shape == (N, H) and lse_out.dtype == torch.float32 and lse_out.device == o1.device
    return N, H, D


def merge_state(
    o1: torch.Tensor,  # (N, H, D) normalized partial over key set 1
    lse1: torch.Tensor,  # (N, H) float32, natural log
    o2: torch.Tensor,  # (N, H, D) over key set 2, disjoint from set 1
    lse2: torch.Tensor,  # (N, H) float32
    out: torch.Tensor | None = None,  # (N, H, D); may alias o1 or o2 (elementwise in place)
    lse_out: torch.Tensor | None = None,  # (N, H) float32; may alias lse1 or lse2
) -> torch.Tensor:
    """Attention over the union of the two key sets: writes out (in o1's dtype if allocated here) and, if
    given, lse_out; returns out. Triton on CUDA tensors (or under TRITON_INTERPRET=1), else the reference."""
    N, H, D = _check_args(o1, lse1, o2, lse2, out, lse_out)
    if out is None:
        out = torch.empty(o1.shape, dtype=o1.dtype, device=o1.device)
    if not _use_triton(o1):
        return merge_state_ref(o1, lse1, o2, lse2, out=out, lse_out=lse_out)
    if N == 0 or H == 0:
        return out
    block_h = min(MERGE_BLOCK_H, next_pow2(H))
    lse_strides = (lse_out.stride(0), lse_out.stride(1)) if lse_out is not None else (0, 0)
    _merge_kernel[(N, cdiv(H, block_h))](
        o1, lse1, o2, lse2, out, lse_out if lse_out is not None else lse1, H,
        o1.stride(0), o1.stride(1), lse1.stride(0), lse1.stride(1), o2.stride(0), o2.stride(1),
        lse2.stride(0), lse2.stride(1), out.stride(0), out.stride(1), *lse_strides,
        D=D, BLOCK_H=block_h, WRITE_LSE=lse_out is not None, num_warps=MERGE_WARPS)
    return out


def merge_state_ref(
    o1: torch.Tensor,
    lse1: torch.Tensor,
    o2: torch.Tensor,
    lse2: torch.Tensor,
    out: torch.Tensor | None = None,
    lse_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The torch reference of merge_state (same contract), float32 math."""
    _check_args(o1, lse1, o2, lse2, out, lse_out)
    m = torch.maximum(lse1, lse2)
    m = torch.where(torch.isneginf(m), 0.0, m)  # (N, H)
    w1, w2 = torch.exp(lse1 - m), torch.exp(lse2 - m)  # (N, H) each; 0 for an empty side
    total = w1 + w2
    o = (torch.where(w1[..., None] > 0, w1[..., None] * o1.float(), 0.0)
         + torch.where(w2[..., None] > 0, w2[..., None] * o2.float(), 0.0))  # (N, H, D)
    o = o / torch.where(total > 0, total, 1.0)[..., None]
    lse = torch.where(total > 0, m + torch.log(torch.where(total > 0, total, 1.0)), float("-inf"))  # (N, H)
    if out is None:
        out = torch.empty(o1.shape, dtype=o1.dtype, device=o1.device)
    out.copy_(o)
    if lse_out is not None:
        lse_out.copy_(lse)
    return out
