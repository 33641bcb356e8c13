"""FP8 weights (kernels/fp8_linear.py): quantize / dequantize round trips, the checkpoint scale forms, and the
Triton kernel against the torch reference (in the interpreter on CPU; on the GPU where there is one, inputs moved
there, its fp32 tl.dot running as TF32, hence the tolerance)."""

from __future__ import annotations

import pytest
import torch

from sgnb.kernels.fp8_linear import (
    FP8,
    FP8_MAX,
    Fp8Linear,
    dequantize_fp8,
    fp8_linear_ref,
    quantize_fp8,
    quantize_per_token,
    scales_to_rows,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E4M3_REL = 2.0**-4  # e4m3 keeps 3 mantissa bits: round-to-nearest is within half an ulp, 1/16 of the value


def _w(N: int, K: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(N, K, generator=gen) * torch.rand(N, 1, generator=gen)  # rows of different ranges


@pytest.mark.parametrize("scheme", ["tensor", "channel", "block"])
def test_round_trip(scheme):
    N, K = 200, 300  # not multiples of 128: partial blocks
    w = _w(N, K)
    q, scale = quantize_fp8(w, scheme)
    assert q.dtype == FP8 and q.shape == (N, K)
    assert scale.shape == {"tensor": (), "channel": (N,), "block": (2, 3)}[scheme]
    rows = scales_to_rows(scale, (N, K), block=scheme == "block")
    assert rows.shape == ((N, 3) if scheme == "block" else (N, 1))
    back = dequantize_fp8(q, rows)
    # each element within half an e4m3 step of its value, or of the smallest normal step of its scale
    step = rows.repeat_interleave(128, dim=1)[:, :K] if scheme == "block" else rows
    assert ((back - w).abs() <= E4M3_REL * w.abs() + step * 2.0**-6).all()
    assert q.float().abs().max() <= FP8_MAX
    # quantizing the dequantized weight again gives the same e4m3 values and scales: the grid is stable
    q2, scale2 = quantize_fp8(back, scheme)
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8))
    torch.testing.assert_close(scale2, scale, rtol=1e-6, atol=0)


def test_per_token_activation_scales():
    x = _w(5, 64, seed=1)
    xq, xs = quantize_per_token(x)
    assert xs.shape == (5, 1)
    torch.testing.assert_close(xq.float().abs().amax(dim=1), torch.full((5,), FP8_MAX))
    assert ((xq.float() * xs - x).abs() <= E4M3_REL * x.abs() + xs * 2.0**-6).all()


def test_layer_equals_dequantized_linear():
    lin = torch.nn.Linear(96, 40, bias=True)
    layer = Fp8Linear.from_linear(lin)
    x = torch.randn(3, 7, 96)
    want = torch.nn.functional.linear(x, dequantize_fp8(layer.weight, layer.weight_scale), lin.bias)
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scheme,M", [("channel", 1), ("channel", 20), ("block", 3), ("block", 33)])
def test_triton_equals_reference(scheme, M):
    pytest.importorskip("triton")
    from sgnb.kernels.fp8_linear import _fp8_linear_triton

    N, K = 48, 272  # K: two whole groups of 128 and a partial one
    q, scale = quantize_fp8(_w(N, K, seed=2), scheme)
    rows = scales_to_rows(scale, (N, K), block=scheme == "block")
    x = torch.randn(M, K)
    got = _fp8_linear_triton(x.to(DEVICE), q.to(DEVICE), rows.to(DEVICE)).cpu()
    tol = 1e-4 if DEVICE == "cpu" else 1e-2  # TF32 on a GPU: 10 mantissa bits over K = 272 products
    torch.testing.assert_close(got, fp8_linear_ref(x, q, rows), rtol=tol, atol=tol)


def test_triton_per_token_quantization_equals_reference():
    pytest.importorskip("triton")
    from sgnb.kernels.fp8_linear import _quantize_per_token_triton

    x = _w(4, 1500, seed=4)  # K: one whole block of 1024 and a partial one
    q, s = (t.cpu() for t in _quantize_per_token_triton(x.to(DEVICE)))
    q_ref, s_ref = quantize_per_token(x)
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    # the same e4m3 values, except where rounding carries into the exponent (126.7 -> 128): Triton's interpreter
    # (numpy) drops that carry and gives half the value, 64. The GPU converts in hardware; bench_moe_fp8.py's
    # kernels part checks the _scaled_mm path built on this kernel against the reference there.
    a, b = q.float(), q_ref.float()
    differ = a != b
    assert differ.float().mean() < 0.05
    assert torch.equal(a[differ] * 2, b[differ]) and (torch.log2(b[differ].abs()) % 1 == 0).all()


@pytest.mark.parametrize("M,config", [(1, None), (2, None), (3, (4, 64, 4, 2)), (1, (16, 512, 4, 2)),
                                      (2, (8, 64, 4, 2, 3, 0)), (1, (8, 64, 4, 2, 1, 1)), (3, (4, 32, 4, 2, 4, 1))])
def test_small_m_kernel_equals_reference(M, config):
    """The decode kernel (per-channel scales): partial row tiles (N = 44), a K (272) that is not a multiple of
    BLOCK_K, and rows of x past M masked off; split over K (partial sums added in float32) and with the late sum
    over BLOCK_K."""
    pytest.importorskip("triton")
    from sgnb.kernels.fp8_linear import _fp8_gemv_triton

    N, K = 44, 272
    q, scale = quantize_fp8(_w(N, K, seed=3), "channel")
    rows = scales_to_rows(scale, (N, K), block=False)
    x = torch.randn(M, K).to(torch.bfloat16 if DEVICE == "cuda" else torch.float32)
    got = _fp8_gemv_triton(x.to(DEVICE), q.to(DEVICE), rows.to(DEVICE), config).float().cpu()
    want = fp8_linear_ref(x.float(), q, rows)
    tol = 1e-4 if DEVICE == "cpu" else 2e-2  # bf16 output on a GPU
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
