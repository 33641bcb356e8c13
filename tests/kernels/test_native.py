"""Our C kernel (kernels/csrc/quant_gemv.c, built by kernels/native.py): the int8 GEMV against a torch reference
that rounds the rows the same way, and the q8 head mode of QuantLinear that uses it."""

from __future__ import annotations

import shutil

import pytest
import torch
from torch import nn

from sgnb.kernels import native
from sgnb.kernels.quant_linear import SMALL_M, QuantLinear, choose_mode, q8_is_lossless

needs_native = pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.unavailable_reason()}")


def test_builds_wherever_there_is_a_compiler():
    """CI and these machines have gcc and AVX2: the kernel must build, not fall back silently."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler here")
    assert native.available(), native.unavailable_reason()


def _q8_weight(n: int, k: int, seed: int) -> torch.Tensor:
    """A weight on Q8_0's grid (what a Q8_0 GGUF tensor dequantizes to)."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    q, d = native.quantize_q8(w)
    return (q.float().view(n, -1, native.BLOCK) * d[..., None]).view(n, k)


@needs_native
def test_rows_round_to_int8_per_block():
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(1)) * 4
    xq, dx = native.quantize_rows(x)
    assert xq.dtype == torch.int8 and dx.shape == (3, 3)
    blocks = x.view(3, 3, 32)
    torch.testing.assert_close(dx, blocks.abs().amax(-1) / 127)
    assert (xq.view(3, 3, 32).abs().amax(-1) == 127).all()  # each block's largest element maps to +-127
    err = (xq.float().view(3, 3, 32) * dx[..., None] - blocks).abs()
    assert (err <= dx[..., None] / 2 + 1e-6).all()  # round to nearest


@needs_native
@pytest.mark.parametrize("m", [1, 2, 5, native.MAX_ROWS])
@pytest.mark.parametrize("n,k", [(7, 32), (200, 576), (1031, 1536)])
def test_q8_gemv_equals_reference(m, n, k):
    w = _q8_weight(n, k, seed=n + k)
    q, d = native.quantize_q8(w)
    assert q8_is_lossless(w)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    y = native.q8_gemv(x, q, d)
    xq, dx = native.quantize_rows(x)
    x_seen = (xq.float().view(m, -1, 32) * dx[..., None]).view(m, k)
    ref = x_seen.double() @ w.double().t()  # what the integer dot products compute, in float64
    torch.testing.assert_close(y.double(), ref, atol=1e-4, rtol=1e-4)
    exact = x @ w.t()
    assert ((y - exact).norm() / exact.norm()) < 0.02  # the rows' 8-bit rounding, no more


@needs_native
def test_q8_gemv_rejects_what_it_cannot_run():
    q, d = native.quantize_q8(_q8_weight(8, 64, seed=0))
    with pytest.raises(AssertionError):
        native.q8_gemv(torch.randn(native.MAX_ROWS + 1, 64), q, d)
    with pytest.raises(AssertionError):
        native.q8_gemv(torch.randn(2, 64).t().contiguous().t(), q, d)  # not contiguous


@needs_native
@pytest.mark.parametrize("m", [1, SMALL_M, SMALL_M + 3])
def test_q8_layer_holds_a_q8_weight_exactly(m):
    """The head's mode: decode-sized batches run the kernel, larger ones the bf16 copy of the same weights."""
    lin = nn.Linear(576, 300, bias=False)
    with torch.no_grad():
        lin.weight.copy_(_q8_weight(300, 576, seed=3))
    assert choose_mode(lin.weight, "auto", head=True) == "q8"
    assert choose_mode(torch.randn(300, 576), "auto", head=True) == "bf16"  # off the grid: not lossless
    layer = QuantLinear(lin, "q8")
    x = torch.randn(m, 576, generator=torch.Generator().manual_seed(m))
    got, exact = layer(x), lin(x)
    assert got.shape == (m, 300) and got.dtype == torch.float32
    rel = ((got - exact).norm() / exact.norm()).item()
    assert rel < 0.02, rel
    if m <= SMALL_M:
        torch.testing.assert_close(got, native.q8_gemv(x, *native.quantize_q8(lin.weight)))
