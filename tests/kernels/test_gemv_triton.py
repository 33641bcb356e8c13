"""The decode GEMV (kernels/gemv.py) against torch's linear: every row count up to MAX_ROWS, ragged N and K,
bias, and the split-K path (atomics into an fp32 output).

On a machine without a GPU it runs in the Triton interpreter in fp32 (bf16 is broken there); on CUDA in bf16.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # must precede the kernels' import: triton reads it when decorating
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from sgnb.kernels import _triton_utils  # noqa: E402
from sgnb.kernels.gemv import MAX_ROWS, gemv, gemv_config, gemv_ref  # noqa: E402

CUDA = torch.cuda.is_available()
if not _triton_utils.HAS_TRITON:
    pytest.skip("triton is not installed", allow_module_level=True)
DEVICE = "cuda" if CUDA else "cpu"
DTYPE = torch.bfloat16 if CUDA else torch.float32
TOL = 2e-2 if CUDA else 1e-4


def _case(M, N, K, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(DEVICE, DTYPE)
    w = (torch.randn(N, K, generator=g) / K**0.5).to(DEVICE, DTYPE)
    b = torch.randn(N, generator=g).to(DEVICE, DTYPE) if bias else None
    return x, w, b


@pytest.mark.parametrize("M", [1, 2, 3, 5, MAX_ROWS])
@pytest.mark.parametrize("N,K", [(48, 256), (37, 200), (8, 1536)])
def test_gemv_matches_linear(M, N, K):
    x, w, b = _case(M, N, K, bias=(N == 37))
    ref = gemv_ref(x.float(), w.float(), None if b is None else b.float())
    out = gemv(x, w, b)
    assert out.shape == (M, N) and out.dtype == DTYPE
    torch.testing.assert_close(out.float(), ref, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("bias", [False, True])
def test_split_k_adds_every_range_once(bias):
    """Explicit SPLIT_K = 4 over a K of 4 slices and of a ragged K: each product, and the bias, counted once."""
    for K in (512, 450):
        x, w, b = _case(2, 24, K, bias)
        ref = gemv_ref(x.float(), w.float(), None if b is None else b.float())
        out = gemv(x, w, b, config=(16, 128, 4, 4, 2))
        torch.testing.assert_close(out.float(), ref, atol=TOL, rtol=TOL)


def test_config_splits_k_only_when_the_columns_leave_the_device_idle():
    assert gemv_config(1, 32000, 4096)[2] == 1  # 2000 programs: plenty
    assert gemv_config(1, 12288, 4096)[2] == 1  # 768 programs over 132 SMs
    assert gemv_config(1, 512, 4096)[2] > 1  # 32 programs alone would leave most SMs idle


def test_more_rows_than_the_kernel_takes_fall_back_to_linear():
    x, w, b = _case(MAX_ROWS + 1, 16, 64, bias=True)
    torch.testing.assert_close(gemv(x, w, b).float(), gemv_ref(x.float(), w.float(), b.float()), atol=TOL, rtol=TOL)

