"""Decode attention over the paged KV pool (page size 1): one query token per request, split-K ("flash decoding").

Stage 1, grid (B, Hkv, num_splits): a program takes one request, the G = H / Hkv query heads that share one KV
head, and one contiguous slice of the request's key range (ceil(len / num_splits) keys rounded up to whole tiles,
computed on the device, so the launch shape depends on B and num_splits only). It gathers the slice's K/V rows
through `req_to_token` tile by tile (BLOCK_N slot ids, then the (BLOCK_N, D) rows they name), runs an online
softmax in float32 and writes a normalized partial output and its log-sum-exp to a float32 scratch. The G heads
are the rows of a tl.dot (padded to 16), so each K/V tile is read once per KV head, not once per query head.
Stage 2, grid (B, H), merges the splits by log-sum-exp into out (and lse). With num_splits == 1, stage 1
writes out/lse itself.

LSE convention: natural log, lse = ln sum_j exp(scale * q.k_j). FlashInfer returns base 2 (lse / ln 2 in
ours); the kernels compute in base 2 internally (exp2 is the fast instruction) and convert at the boundary.
An empty key range gives out = 0 and lse = -inf.

CUDA-graph safe: the launch path reads no tensor data on the host; the scratch is allocated per call with a
shape from B, H, D and num_splits only.
"""

from __future__ import annotations

import json
import os

import torch

from ._paged import check_pool_args
from ._triton_utils import HAS_TRITON, constexpr, next_pow2, tl
from ._triton_utils import jit as _jit

# Tiles for Hopper (H200). The G query heads of a KV head are the rows of one tl.dot, padded to 16: measured on
# an H200, this beat a vector (no tl.dot) path even for G = 1 (batch 256 x 1k keys, 32 heads, D 128: 1.08 ms
# against 1.31 ms for the best vector tiles), so every G takes it.
DECODE_BLOCK_N = 64  # keys per tile (128 was as fast: within 5% either way)
DECODE_WARPS = 4
DECODE_STAGES = 3
DECODE_REDUCE_WARPS = 2
# Stage 1's tiles by batch size: (max_batch, block_n, warps, stages) rows in increasing max_batch, the first row
# with B <= max_batch applies; a batch past the last row takes the defaults above. Empty unless measured on the
# device it runs on: a JSON file of such rows named by $SGNB_DECODE_TILES (benchmarks/gpu/decode_split_sweep.py
# --tiles-out writes one) replaces it at import.
DECODE_TILES: list[tuple[int, int, int, int]] = []


def _load_tiles() -> None:
    path = os.environ.get("SGNB_DECODE_TILES")
    if path:
        with open(path) as f:
            rows = json.load(f)
        DECODE_TILES[:] = sorted((int(r["max_batch"]), int(r["block_n"]), int(r["warps"]), int(r["stages"]))
                                 for r in rows)


_load_tiles()


def decode_tiles(batch_size: int) -> tuple[int, int, int]:
    """(block_n, warps, stages) of stage 1 for a batch of batch_size requests."""
    for max_batch, block_n, warps, stages in DECODE_TILES:
        if batch_size <= max_batch:
            return block_n, warps, stages
    return DECODE_BLOCK_N, DECODE_WARPS, DECODE_STAGES


_HOST_LOG2E = 1.4426950408889634  # log2(e): the wrapper folds it into the scale, so scores are base 2 for exp2
_LOG2E = constexpr(_HOST_LOG2E)
_LN2 = constexpr(0.6931471805599453)  # ln(2): base-2 lse back to natural log
# finite start of the running max: a fully masked tile then gives exp2(-inf - m) = 0 and alpha = 1, no NaN
_NEG_BIG = constexpr(-1.0e30)


@_jit(do_not_specialize=["kv_start_val"])  # the cascade's shared length: see extend_attention
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, req_to_token_ptr, req_pool_ptr, kv_start_ptr, kv_end_ptr, o_ptr, lse_ptr,
    kv_start_val, qk_scale, stride_qb, stride_qh, stride_kvs, stride_kvh, stride_rt,
    G: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    START_TENSOR: tl.constexpr, WRITE_LSE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One (request, KV head, split): the G query heads of the KV head as BLOCK_H (>= 16) rows of a tl.dot.
    Writes o (B, H, num_splits, D) and lse (B, H, num_splits), both contiguous (num_splits = 1: the results)."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)

    row = tl.load(req_pool_ptr + b).to(tl.int64)
    if START_TENSOR:
        start = tl.load(kv_start_ptr + b).to(tl.int32)
    else:
        start = kv_start_val
    end = tl.load(kv_end_ptr + b).to(tl.int32)
    length = tl.maximum(end - start, 0)
    split_len = tl.cdiv(tl.cdiv(length, num_splits), BLOCK_N) * BLOCK_N  # whole tiles per split
    lo = start + split * split_len
    hi = tl.minimum(lo + split_len, end)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, D)
    head_ok = offs_h < G
    heads = kvh * G + offs_h
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=head_ok[:, None], other=0.0)  # (BLOCK_H, D)

    rt = req_to_token_ptr + row * stride_rt
    k_base = k_ptr + kvh * stride_kvh
    v_base = v_ptr + kvh * stride_kvh
    m_i = tl.full([BLOCK_H], _NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        key_ok = offs_n < hi
        slots = tl.load(rt + offs_n, mask=key_ok, other=0).to(tl.int64)
        kv_offs = slots[:, None] * stride_kvs + offs_d[None, :]  # (BLOCK_N, D)
        k = tl.load(k_base + kv_offs, mask=key_ok[:, None], other=0.0)
        v = tl.load(v_base + kv_offs, mask=key_ok[:, None], other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # (BLOCK_H, BLOCK_N), base 2
        qk = tl.where(key_ok[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    seen = l_i > 0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    part = (b.to(tl.int64) * G * tl.num_programs(1) + heads) * num_splits + split  # (BLOCK_H,) row of o / lse
    tl.store(o_ptr + part[:, None] * D + offs_d[None, :], o.to(o_ptr.dtype.element_ty), mask=head_ok[:, None])
    if WRITE_LSE:
        lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * _LN2, float("-inf"))
        tl.store(lse_ptr + part, lse, mask=head_ok)


@_jit
def _decode_reduce_kernel(po_ptr, plse_ptr, out_ptr, lse_ptr, D: tl.constexpr, SPLITS: tl.constexpr,
                          SPLITS_P2: tl.constexpr, WRITE_LSE: tl.constexpr):
    """One (request, query head): merge the SPLITS partials (normalized o, natural-log lse) by lse.
    po (B, H, SPLITS, D), plse (B, H, SPLITS), out (B, H, D), lse (B, H), all contiguous."""
    bh = tl.program_id(0).to(tl.int64) * tl.num_programs(1) + tl.program_id(1)  # b * H + h
    offs_s = tl.arange(0, SPLITS_P2)
    offs_d = tl.arange(0, D)
    split_ok = offs_s < SPLITS
    lse = tl.load(plse_ptr + bh * SPLITS + offs_s, mask=split_ok, other=float("-inf"))  # (S,)
    o = tl.load(po_ptr + (bh * SPLITS + offs_s[:, None]) * D + offs_d[None, :], mask=split_ok[:, None],
                other=0.0)  # (S, D)
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # every split empty: weights exp(-inf) = 0, no NaN
    w = tl.exp2((lse - m) * _LOG2E)  # (S,)
    total = tl.sum(w, 0)
    seen = total > 0
    out = tl.sum(tl.where(w[:, None] > 0, w[:, None] * o, 0.0), 0) / tl.where(seen, total, 1.0)  # (D,)
    tl.store(out_ptr + bh * D + offs_d, out.to(out_ptr.dtype.element_ty))
    if WRITE_LSE:
        tl.store(lse_ptr + bh, tl.where(seen, m + tl.log(tl.where(seen, total, 1.0)), float("-inf")))


INTERPRETED = HAS_TRITON and type(_decode_split_kernel).__name__ == "InterpretedFunction"
"""Whether the kernels were decorated under TRITON_INTERPRET=1 (then they also run on CPU tensors)."""


def _use_triton(t: torch.Tensor) -> bool:
    return HAS_TRITON and (t.is_cuda or INTERPRETED)


def _check_args(q, k_buf, v_buf, req_to_token, req_pool_indices, kv_start, kv_end, out, lse) -> tuple[int, ...]:
    """Shape/stride/dtype checks at the boundary (metadata only: no device reads). Returns (B, H, Hkv, D)."""
    B, H, Hkv, D = check_pool_args(q, k_buf, v_buf, req_to_token, req_pool_indices, kv_start, kv_end)
    assert q.shape[0] == B, (q.shape, B)
    if out is not None:  # contiguous: the kernels derive its strides from (B, H, D)
        assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous(), (out.shape, out.stride())
        assert out.device == q.device
    if lse is not None:
        assert lse.shape == (B, H) and lse.dtype == torch.float32 and lse.is_contiguous(), (lse.shape, lse.dtype)
        assert lse.device == q.device
    return B, H, Hkv, D


def decode_attention(
    q: torch.Tensor,  # (B, H, D) one query token per request
    k_buf: torch.Tensor,  # (S, Hkv, D) the layer's K pool; slot 0 is padding
    v_buf: torch.Tensor,  # (S, Hkv, D)
    req_to_token: torch.Tensor,  # (R, C) int32/int64: slot of each position of each request row
    req_pool_indices: torch.Tensor,  # (B,) int: row of req_to_token per request
    kv_start: int | torch.Tensor,  # python int or (B,) int tensor: first key position
    kv_end: torch.Tensor,  # (B,) int: one past the last key position
    scale: float,
    out: torch.Tensor | None = None,  # (B, H, D) q.dtype, contiguous
    lse: torch.Tensor | None = None,  # (B, H) float32, contiguous
    num_splits: int = 8,
    tiles: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """Request i attends to the keys at positions [kv_start(_i), kv_end[i]) of its row (position p is the slot
    req_to_token[req_pool_indices[i], p]), all H heads, head h on KV head h // (H // Hkv).

    Writes out (B, H, D) in q.dtype (allocated if None) and, if lse is given, lse (B, H) float32, natural log;
    an empty range gives out = 0 and lse = -inf. Returns out. Triton on CUDA tensors (or anywhere under
    TRITON_INTERPRET=1), else the torch reference. No host syncs on the Triton path (CUDA-graph safe).
    num_splits: key-range slices per request, each its own program: more for small batches of long contexts,
    1 for large batches (default_num_splits(B, Hkv) picks one from the batch shape). k_buf and v_buf share strides.
    tiles: stage 1's (block_n, warps, stages); None: decode_tiles(B).
    """
    B, H, Hkv, D = _check_args(q, k_buf, v_buf, req_to_token, req_pool_indices, kv_start, kv_end, out, lse)
    assert num_splits >= 1, num_splits
    assert k_buf.stride() == v_buf.stride(), (k_buf.stride(), v_buf.stride())
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if not _use_triton(q):
        return decode_attention_ref(q, k_buf, v_buf, req_to_token, req_pool_indices, kv_start, kv_end, scale,
                                    out=out, lse=lse)
    if B == 0:
        return out
    G = H // Hkv
    block_n, warps, stages = tiles or decode_tiles(B)
    start_tensor = isinstance(kv_start, torch.Tensor)
    if num_splits == 1:  # stage 1 writes the results: out and lse are its (B, H, 1, D) and (B, H, 1)
        po, plse = out, (lse if lse is not None else out)
    else:
        po = torch.empty(B, H, num_splits, D, dtype=torch.float32, device=q.device)  # (B, H, splits, D)
        plse = torch.empty(B, H, num_splits, dtype=torch.float32, device=q.device)  # (B, H, splits)
    _decode_split_kernel[(B, Hkv, num_splits)](
        q, k_buf, v_buf, req_to_token, req_pool_indices, kv_start if start_tensor else kv_end, kv_end, po, plse,
        0 if start_tensor else int(kv_start), scale * _HOST_LOG2E, q.stride(0), q.stride(1), k_buf.stride(0),
        k_buf.stride(1), req_to_token.stride(0),
        G=G, D=D, BLOCK_H=max(16, next_pow2(G)), BLOCK_N=block_n, START_TENSOR=start_tensor,
        WRITE_LSE=num_splits > 1 or lse is not None, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=warps, num_stages=stages)
    if num_splits > 1:
        _decode_reduce_kernel[(B, H)](
            po, plse, out, lse if lse is not None else plse, D=D, SPLITS=num_splits,
            SPLITS_P2=next_pow2(num_splits), WRITE_LSE=lse is not None,
            num_warps=DECODE_REDUCE_WARPS)
    return out


def default_num_splits(batch_size: int, num_kv_heads: int, num_sms: int = 132) -> int:
    """A num_splits that fills the GPU: about two stage-1 programs per multiprocessor, 1 to 32 (a host int of
    the batch shape only, so it is fixed for a CUDA graph of that batch size). Measured on an H200 (32 query
    heads, D 128, contexts 1k/4k): one split is best from batch 64 x 32 KV heads up, 16-32 for batch 1."""
    want = -(-2 * num_sms // max(1, batch_size * num_kv_heads))
    return 1 << min(5, max(0, (want - 1).bit_length()))  # the power of two >= want, capped at 32


DECODE_REF_CHUNK = 1 << 16  # padded (request, key) pairs gathered at once by the reference


def decode_attention_ref(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    kv_start: int | torch.Tensor,
    kv_end: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    num_splits: int = 8,  # accepted for the same signature; the reference does not split
) -> torch.Tensor:
    """The torch reference of decode_attention (same contract), float32 math over a padded gather of the
    requests' keys, a chunk of requests at a time. Reads lengths on the host: not CUDA-graph safe."""
    B, H, Hkv, D = _check_args(q, k_buf, v_buf, req_to_token, req_pool_indices, kv_start, kv_end, out, lse)
    G = H // Hkv
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    dev = q.device
    starts = kv_start.long() if isinstance(kv_start, torch.Tensor) else torch.full((B,), int(kv_start), device=dev)
    lens = (kv_end.long() - starts).clamp(min=0)  # (B,)
    rows = req_pool_indices.long()
    C = req_to_token.shape[1]
    step = max(1, DECODE_REF_CHUNK // max(1, int(lens.max())))
    for c in range(0, B, step):
        sl = slice(c, c + step)
        n = int(lens[sl].max())
        b = lens[sl].shape[0]
        cols = torch.arange(n, device=dev)  # (n,)
        visible = cols[None, :] < lens[sl, None]  # (b, n)
        pos = (starts[sl, None] + cols[None, :]).clamp(max=C - 1)  # (b, n)
        slots = torch.where(visible, req_to_token[rows[sl, None], pos].long(), 0)  # (b, n)
        k = k_buf[slots].float()  # (b, n, Hkv, D); padding reads slot 0, masked below
        v = torch.where(visible[:, :, None, None], v_buf[slots].float(), 0.0)  # (b, n, Hkv, D); 0 * NaN = NaN
        qg = q[sl].float().view(b, Hkv, G, D)  # (b, Hkv, G, D)
        scores = torch.einsum("bkgd,bnkd->bkgn", qg, k) * scale  # (b, Hkv, G, n)
        scores.masked_fill_(~visible[:, None, None, :], float("-inf"))
        lse_c = torch.logsumexp(scores, dim=-1)  # (b, Hkv, G); -inf for an empty range
        probs = torch.exp(scores - lse_c.clamp(min=-1e30).unsqueeze(-1))  # exp(-inf) = 0 on masked keys
        o = torch.einsum("bkgn,bnkd->bkgd", probs, v)  # (b, Hkv, G, D)
        out[sl] = o.reshape(b, H, D).to(out.dtype)  # (b, H, D)
        if lse is not None:
            lse[sl] = lse_c.reshape(b, H)  # (b, H)
    return out

