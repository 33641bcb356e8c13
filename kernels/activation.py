"""SiLU-and-multiply, the Llama MLP's gate: a Triton kernel over (row, column block) and the torch reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._triton_utils import cdiv, jit, next_pow2, tl, use_triton

_MAX_BLOCK = 1024  # columns per program: no reduction here, so rows as wide as 14336 are split across programs


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x (..., 2I) = [gate | up] -> silu(gate) * up (..., I) in x's dtype, float32 math."""
    inter = x.shape[-1] // 2
    return (F.silu(x[..., :inter].float()) * x[..., inter:].float()).to(x.dtype)


@jit
def _silu_and_mul_kernel(x_ptr, y_ptr, x_stride, y_stride, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * x_stride + inter + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * y_stride + cols, (g * tl.sigmoid(g) * u).to(y_ptr.dtype.element_ty), mask=mask)


def _silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    assert x.shape[-1] % 2 == 0 and x.stride(-1) == 1, (x.shape, x.stride())
    inter = x.shape[-1] // 2
    x2 = x if x.dim() == 2 else x.view(-1, x.shape[-1])  # (T, 2I), a 2-D x keeps its row stride
    y = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    y2 = y.view(-1, inter)  # (T, I)
    T = x2.shape[0]
    if T == 0 or inter == 0:
        return y
    BLOCK = min(next_pow2(inter), _MAX_BLOCK)
    _silu_and_mul_kernel[(T, cdiv(inter, BLOCK))](x2, y2, x2.stride(0), y2.stride(0), inter, BLOCK=BLOCK,
                                              num_warps=min(max(BLOCK // 256, 1), 4))
    return y


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x (T, 2I) = [gate | up] (rows may be strided, last dim contiguous) -> a new (T, I) tensor
    silu(gate) * up in x's dtype, float32 math. Mutates nothing. Triton on CUDA, silu_and_mul_ref on CPU."""
    if use_triton(x):
        return _silu_and_mul_triton(x)
    from . import native

    if x.dim() == 2 and native.takes(x):  # one pass on the CPU
        return native.silu_mul(x)
    return silu_and_mul_ref(x)
