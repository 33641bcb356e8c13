"""RMSNorm, plain and fused with the residual add: a Triton kernel per row and the torch reference.

The math is HF Llama's: float32 inside, the normalized x rounded to the input dtype, then times the weight.
"""

from __future__ import annotations

import torch

from ._triton_utils import jit, next_pow2, tl, use_triton


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = x / rms(x) * weight, computed in float32 like HF Llama, cast back to x's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def fused_add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x in place (in residual's dtype); returns (rms_norm_ref(residual), residual)."""
    residual.add_(x)
    return rms_norm_ref(residual, weight, eps), residual


@jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, y_ptr, x_stride, res_stride, y_stride, N, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    # one program per row; the whole row sits in registers (BLOCK >= N)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0).to(tl.float32)
        # round the sum to the residual's dtype first, as residual.add_(x) does, and normalize that
        s = (x + r).to(res_ptr.dtype.element_ty)
        tl.store(res_ptr + row * res_stride + cols, s, mask=mask)
        x = s.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    xn = (x * rstd).to(y_ptr.dtype.element_ty).to(tl.float32)  # HF rounds x_normed to the input dtype
    tl.store(y_ptr + row * y_stride + cols, (xn * w).to(y_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x (..., N) as (T, N) without copying the rows; a 2-D x keeps its row stride."""
    assert x.stride(-1) == 1, f"the last dim must be contiguous, got strides {x.stride()}"
    return x if x.dim() == 2 else x.view(-1, x.shape[-1])  # (T, N)


def _rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                     residual: torch.Tensor | None = None) -> torch.Tensor:
    """rms_norm(x), or with residual: residual += x in place, then rms_norm(residual)."""
    src = x if residual is None else residual  # the tensor that gets normalized
    N = src.shape[-1]
    assert weight.shape == (N,) and weight.stride(0) == 1, (weight.shape, N)
    assert weight.dtype == src.dtype, f"weight {weight.dtype} != input {src.dtype} (HF keeps them equal)"
    assert weight.device == src.device, (weight.device, src.device)
    x2 = _rows(x)  # (T, N)
    r2 = _rows(residual) if residual is not None else x2  # (T, N), unused without residual
    y = torch.empty(src.shape, dtype=src.dtype, device=src.device)
    y2 = y.view(-1, N)  # (T, N)
    T = x2.shape[0]
    if T == 0:
        return y
    BLOCK = next_pow2(N)
    _rms_norm_kernel[(T,)](x2, r2, weight, y2, x2.stride(0), r2.stride(0), y2.stride(0), N, eps,
                           HAS_RESIDUAL=residual is not None, BLOCK=BLOCK,
                           num_warps=min(max(BLOCK // 256, 1), 8))
    return y


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim: x (T, N) (or (..., N); rows may be strided, the last dim contiguous) ->
    a new contiguous tensor of x's shape and dtype. Mutates nothing. Triton on CUDA, rms_norm_ref on CPU."""
    if use_triton(x):
        return _rms_norm_triton(x, weight, eps)
    from . import native

    if native.takes(x, weight):  # one pass on the CPU
        return native.rms_norm(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """residual <- residual + x IN PLACE (rounded to residual's dtype); returns (rms_norm(residual), residual).

    x and residual have the same shape (T, N); x is not modified. One read of each, one write of each output.
    """
    assert x.shape == residual.shape, (x.shape, residual.shape)
    if use_triton(residual):
        return _rms_norm_triton(x, weight, eps, residual), residual
    from . import native

    if native.takes(x, residual, weight) and residual.is_contiguous():  # one pass on the CPU
        return native.rms_norm(x, weight, eps, residual), residual
    return fused_add_rms_norm_ref(x, residual, weight, eps)
