"""Grammar-constrained decoding: ban the tokens a packed bitmask rules out, as a Triton kernel and in torch.

Bitmask layout (xgrammar's): int32 (B, W), bit j of word w is token 32*w + j, 1 = allowed, 0 = banned.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._triton_utils import cdiv, jit, tl, use_triton

_BIT = (1 << torch.arange(32, dtype=torch.int64)).to(torch.int32)  # bit 31 wraps to INT32_MIN, as wanted
_BLOCK_W = 32  # words per program: 1024 tokens (H200: 16..64 within 20%; fewer stores per thread won)


def _check(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    assert logits.dim() == 2 and logits.is_floating_point(), (logits.shape, logits.dtype)
    assert bitmask.dim() == 2 and bitmask.dtype == torch.int32, (bitmask.shape, bitmask.dtype)
    assert bitmask.device == logits.device, (bitmask.device, logits.device)


def apply_token_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor,
                            rows: Sequence[int] | torch.Tensor | None = None) -> None:
    """apply_token_bitmask's contract in torch: unpack the words to a (R, V) banned mask and masked_fill."""
    _check(logits, bitmask)
    B, V = logits.shape
    W = bitmask.shape[1]
    if rows is None:
        assert bitmask.shape[0] >= B, (bitmask.shape, B)
        idx = None
        R = B
    else:
        idx = (rows.to(device=logits.device, dtype=torch.int64) if isinstance(rows, torch.Tensor)
               else torch.tensor(list(rows), dtype=torch.int64, device=logits.device))  # (R,)
        R = idx.numel()
        if R == 0:
            return
    words = bitmask[:B] if idx is None else bitmask[idx]  # (R, W)
    banned = words.unsqueeze(-1).bitwise_and(_BIT.to(bitmask.device)).eq(0).flatten(1)  # (R, W*32)
    if W * 32 >= V:
        banned = banned[:, :V]  # (R, V)
    else:
        banned = torch.cat([banned, banned.new_ones(R, V - W * 32)], dim=1)  # (R, V): past the words, banned
    if idx is None:
        logits.masked_fill_(banned, float("-inf"))
    else:
        logits[idx] = logits[idx].masked_fill(banned, float("-inf"))


@jit
def _bitmask_kernel(logits_ptr, bitmask_ptr, rows_ptr, logits_stride, bitmask_stride, V, W,
                    HAS_ROWS: tl.constexpr, BLOCK_W: tl.constexpr):
    # program (i, j): row rows[i] (or i), words j*BLOCK_W ...; writes -inf to the banned tokens and reads no logits
    if HAS_ROWS:
        row = tl.load(rows_ptr + tl.program_id(0)).to(tl.int64)
    else:
        row = tl.program_id(0).to(tl.int64)
    w = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    words = tl.load(bitmask_ptr + row * bitmask_stride + w, mask=w < W, other=0)  # (BLOCK_W,); past W: banned
    bit = tl.arange(0, 32)
    banned = ((words[:, None] >> bit[None, :]) & 1) == 0  # (BLOCK_W, 32)
    tok = w[:, None] * 32 + bit[None, :]  # (BLOCK_W, 32) token ids
    neg_inf = tl.full((BLOCK_W, 32), float("-inf"), logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row * logits_stride + tok, neg_inf, mask=banned & (tok < V))


def _apply_token_bitmask_triton(logits: torch.Tensor, bitmask: torch.Tensor,
                                rows: Sequence[int] | torch.Tensor | None) -> None:
    _check(logits, bitmask)
    assert logits.stride(1) == 1 and bitmask.stride(1) == 1, (logits.stride(), bitmask.stride())
    B, V = logits.shape
    W = bitmask.shape[1]
    if rows is None:
        assert bitmask.shape[0] >= B, (bitmask.shape, B)
        rows_t, R = logits, B  # rows_t is a placeholder pointer, never read
    elif isinstance(rows, torch.Tensor):
        assert rows.dim() == 1 and not rows.is_floating_point() and rows.device == logits.device, (
            rows.shape, rows.dtype, rows.device)
        rows_t, R = rows.contiguous(), rows.numel()  # bounds not checked: that would sync the GPU
    else:
        rows = list(rows)
        assert all(0 <= r < min(B, bitmask.shape[0]) for r in rows), (rows, B, bitmask.shape)
        rows_t, R = torch.tensor(rows, dtype=torch.int32, device=logits.device), len(rows)
    if R == 0 or V == 0:
        return
    _bitmask_kernel[(R, cdiv(cdiv(V, 32), _BLOCK_W))](logits, bitmask, rows_t, logits.stride(0), bitmask.stride(0),
                                                      V, W, HAS_ROWS=rows is not None, BLOCK_W=_BLOCK_W,
                                                      num_warps=4)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                        rows: Sequence[int] | torch.Tensor | None = None) -> None:
    """In place: logits[r, t] = -inf where bit t of bitmask[r] is 0, for r in rows (default: all B rows).

    logits (B, V) float; bitmask (B', W) int32 on the same device. `rows` index logits AND bitmask alike (row r
    of logits takes row r of the bitmask); default all rows, then B' >= B. Columns past W*32 are banned. Other
    rows and allowed tokens are untouched. Same contract as engine/grammar.py's apply_bitmask_torch. rows may
    also be an int tensor (R,) on logits' device: the CUDA-graph-safe form (a list is copied to the GPU).
    Triton on CUDA (one launch, writes only the banned entries), apply_token_bitmask_ref on CPU.
    """
    if use_triton(logits):
        _apply_token_bitmask_triton(logits, bitmask, rows)
    else:
        apply_token_bitmask_ref(logits, bitmask, rows)
