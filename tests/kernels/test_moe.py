"""The fused-MoE Triton kernel (kernels/moe.py) against its torch reference: in Triton's interpreter on CPU, on the
GPU where there is one (inputs made on the CPU, moved there; fp32 tl.dot runs as TF32 on a GPU, hence its tolerance)."""

from __future__ import annotations

import pytest
import torch

from sgnb.kernels.moe import (
    _fused_moe_triton,
    _moe_align_triton,
    _select_experts_triton,
    fused_moe_ref,
    moe_align,
    select_experts,
)

triton = pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DOT_TOL = 1e-4 if DEVICE == "cpu" else 5e-3  # TF32 keeps 10 mantissa bits


def _dev(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(DEVICE) for t in tensors]


def _case(T: int, E: int, k: int, H: int, inter: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen)
    w13 = torch.randn(E, 2 * inter, H, generator=gen) / H**0.5
    w2 = torch.randn(E, H, inter, generator=gen) / inter**0.5
    weights, ids = select_experts(torch.randn(T, E, generator=gen), k, renormalize=True)
    return x, w13, w2, weights, ids


@pytest.mark.parametrize("align", [moe_align, _moe_align_triton])
def test_align_groups_pairs_by_expert(align):
    ids = torch.tensor([[3, 0], [3, 1], [0, 3]])
    pairs, block_expert, total = (t.cpu() for t in align(ids.to(DEVICE), num_experts=5, block_m=2))
    P = ids.numel()
    n = int(total)
    assert n == 2 + 2 + 4  # experts 0 (2 pairs), 1 (1, padded), 3 (3, padded)
    assert block_expert.numel() == 3 + 5 and block_expert[n // 2:].eq(5).all()
    flat = ids.reshape(-1)
    seen = []
    for b in range(n // 2):
        for p in pairs[2 * b: 2 * b + 2].tolist():
            if p < P:
                assert flat[p] == block_expert[b]
                seen.append(p)
    assert sorted(seen) == list(range(P)) and pairs[n:].eq(P).all()


@pytest.mark.parametrize("gemv", [False, True], ids=["grouped", "gemv"])
@pytest.mark.parametrize("T,E,k,H,inter", [(1, 8, 2, 32, 16), (5, 4, 2, 48, 24), (19, 6, 3, 32, 40)])
def test_triton_equals_reference(T, E, k, H, inter, gemv):
    """Both Triton paths (the grouped GEMM and the few-token GEMV kernels, forced), on shapes whose K and
    intermediate size are not multiples of the tiles, against the reference."""
    x, w13, w2, weights, ids = _case(T, E, k, H, inter)
    want = fused_moe_ref(x, w13, w2, weights, ids)
    got = _fused_moe_triton(*_dev(x, w13, w2, weights, ids), gemv=gemv).cpu()
    torch.testing.assert_close(got, want, rtol=DOT_TOL, atol=DOT_TOL)


def test_gemv_kernels_cover_several_tiles_and_bf16():
    """The GEMV kernels with tiles smaller than the shapes (several programs along the outputs, several steps
    along K, ragged ends) and on bf16 inputs (float32 accumulation, one rounding of the intermediate), and the
    dispatch: one token or few pairs per expert take them."""
    from sgnb.kernels.moe import _fused_moe_gemv, use_moe_gemv

    x, w13, w2, weights, ids = _case(3, 32, 4, 72, 40, seed=1)
    want = fused_moe_ref(x, w13, w2, weights, ids)
    tiles = {"up": (8, 32, 1), "down": (16, 16, 1)}
    got = _fused_moe_gemv(*_dev(x, w13, w2, weights, ids), tiles=tiles).cpu()
    torch.testing.assert_close(got, want, rtol=DOT_TOL, atol=DOT_TOL)
    got = _fused_moe_gemv(*_dev(x.bfloat16(), w13.bfloat16(), w2.bfloat16(), weights, ids), tiles=tiles).cpu()
    want = fused_moe_ref(x.bfloat16().float(), w13.bfloat16().float(), w2.bfloat16().float(), weights, ids)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
    assert use_moe_gemv(1, 8, 2) and use_moe_gemv(2, 128, 8) and not use_moe_gemv(4, 128, 8)
    assert not use_moe_gemv(2, 8, 2)  # Mixtral: two tokens' four pairs over 8 experts share them often


def test_triton_align_matches_torch_align():
    """Both aligns give each expert the same padded run (the order inside a run may differ)."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.stack([torch.randperm(16, generator=gen)[:4] for _ in range(37)])  # (37, 4), E = 16
    a, b = moe_align(ids, 16, 16), tuple(t.cpu() for t in _moe_align_triton(ids.to(DEVICE), 16, 16))
    assert torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])
    n = int(a[2])
    for e in range(16):
        runs = [p[:n].view(-1, 16)[blocks[: n // 16] == e].reshape(-1) for p, blocks in (a[:2], b[:2])]
        assert sorted(runs[0].tolist()) == sorted(runs[1].tolist())


def test_reference_equals_dense_sum():
    """The reference against the definition: every expert on every token, masked by the routing."""
    x, w13, w2, weights, ids = _case(6, 4, 2, 16, 8, seed=1)
    dense = torch.zeros_like(x)
    for e in range(4):
        g, u = (x @ w13[e].t()).chunk(2, dim=-1)
        y = (torch.nn.functional.silu(g) * u) @ w2[e].t()  # (T, H)
        dense += y * (weights * (ids == e)).sum(-1, keepdim=True)
    torch.testing.assert_close(fused_moe_ref(x, w13, w2, weights, ids), dense, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("E,k,renormalize", [(8, 2, True), (6, 3, False), (128, 8, True)])
def test_triton_router_equals_reference(E, k, renormalize):
    logits = torch.randn(5, E, generator=torch.Generator().manual_seed(E))
    w_ref, ids_ref = select_experts(logits, k, renormalize)  # CPU tensors: the reference
    w, ids = (t.cpu() for t in _select_experts_triton(logits.to(DEVICE), k, renormalize))
    assert ids.dtype == torch.int32 and torch.equal(ids.long(), ids_ref)
    tol = 1e-6 if DEVICE == "cpu" else 1e-5  # the GPU's exp differs from the CPU's in the last bits
    torch.testing.assert_close(w, w_ref, rtol=tol, atol=tol / 10)
