"""Extend (prefill) attention over the paged KV pool (page size 1): ragged queries, flash-attention tiles.

Grid (B, H, cdiv(max_q_len, BLOCK_M)): a program takes BLOCK_M consecutive queries of one request and one query
head (programs whose block starts past the request's query count exit at once), then walks the request's key
range in BLOCK_N tiles gathered through `req_to_token` (BLOCK_N slot ids, then the (BLOCK_N, D) K/V rows),
with tl.dot for QK^T and PV and an online softmax in float32. The walk has two phases: tiles that every query
of the block sees in full run with no mask at all; the rest (the causal diagonal and the range's tail) run
masked. Callers write the new tokens' K/V into the pool first, so all keys come from the pool.

Causal alignment is bottom-right: with L = kv_end[i] and n queries, query j sees key positions p <= L - n + j
(the new tokens are the last n positions of the range). A sliding window W (causal only) also hides the keys
p <= L - n + j - W: each query sees its own position and the W - 1 before it (transformers' convention); a
block then starts at its first row's window, with masked tiles until every row's window has begun.
LSE: natural log (FlashInfer's is base 2); rows that see no key get out = 0 and lse = -inf. No host syncs on the Triton path (CUDA-graph safe).
"""

from __future__ import annotations

import numpy as np
import torch

from ._paged import check_pool_args
from ._triton_utils import HAS_TRITON, cdiv, constexpr, next_pow2, tl
from ._triton_utils import jit as _jit

# Tiles for Hopper (H200); BLOCK_M shrinks to the batch's longest query run (short chunks, decode-like batches).
# Measured on an H200 (D 128, bf16, 32 query heads): 64 x 64 tiles, 4 warps, 3 stages (no spills, wgmma) beat
# 128 x 64 with 8 warps by 5-35%; 128 x 64 with 4 warps spills but is 10-20% faster on chunks over a long
# prefix (16 x 256 queries over 1280 keys) and 40-70% slower on the shared-prefix pass (256 queries, 1 request).
EXTEND_BLOCK_M = 64
EXTEND_BLOCK_N = 64
EXTEND_MIN_BLOCK_M = 16  # tl.dot needs >= 16 rows
EXTEND_WARPS = 4
EXTEND_STAGES = 3
# Long causal query runs (a long prompt, or its chunks): their own tiles (BLOCK_M, BLOCK_N, num_warps,
# num_stages) from EXTEND_LONG_MIN queries on, and their query blocks in descending order (EXTEND_REVERSE: the
# grid's last axis reversed; the blocks near the prompt's end see the most keys, and launched first they no
# longer make the grid's last, lone wave). None: the tiles above, in order. Measured on the H200 (32 x 128
# heads, bf16; benchmarks/gpu/extend_sweep.py, 2026-12-03): one layer of a fresh 8k prompt in 2k chunks 1.58 ms
# (348 TFLOP/s of visible scores) against 1.76 with the tiles above; 8 x 1k 0.417 against 0.434 ms. The
# block-table launch (extend CUDA graphs) and non-causal passes (a shared prefix) keep the tiles above.
EXTEND_LONG_MIN = 1024
EXTEND_LONG_TILES: tuple[int, int, int, int] | None = (128, 64, 4, 3)
EXTEND_REVERSE = True


def _extend_config(head_dim: int, max_q_len: int, long: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for a head size and the batch's longest query run; long=True
    (a causal grid launch) may take the long-run tiles."""
    if long and EXTEND_LONG_TILES is not None and max_q_len >= EXTEND_LONG_MIN:
        return EXTEND_LONG_TILES
    block_m = min(EXTEND_BLOCK_M, max(EXTEND_MIN_BLOCK_M, next_pow2(max(max_q_len, 1))))
    num_warps = EXTEND_WARPS if block_m >= 64 else 4
    return block_m, EXTEND_BLOCK_N, num_warps, EXTEND_STAGES


_HOST_LOG2E = 1.4426950408889634  # log2(e): the wrapper folds it into the scale, so scores are base 2 for exp2
_LN2 = constexpr(0.6931471805599453)  # ln(2): base-2 lse back to natural log
# finite start of the running max: a fully masked row then gets exp2(-inf - m) = 0 and alpha = 1, no NaN
_NEG_BIG = constexpr(-1.0e30)


@_jit
def _attend_tile(
    acc, l_i, m_i, q, n0, rt, k_base, v_base, stride_ks, stride_vs, kv_end, diag, offs_m, qk_scale, window,
    D: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr, WINDOW: tl.constexpr = False,
):
    """One key tile [n0, n0 + BLOCK_N) into the running (acc, l, m). MASKED: bounds (p < kv_end) and, if
    CAUSAL, p <= diag + row (and with WINDOW, p > diag + row - window); unmasked tiles are known to be in range
    and visible to every row."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    if MASKED:
        in_range = offs_n < kv_end
        slots = tl.load(rt + offs_n, mask=in_range, other=0).to(tl.int64)
        k = tl.load(k_base + slots[:, None] * stride_ks + offs_d[None, :], mask=in_range[:, None], other=0.0)
        v = tl.load(v_base + slots[:, None] * stride_vs + offs_d[None, :], mask=in_range[:, None], other=0.0)
    else:
        slots = tl.load(rt + offs_n).to(tl.int64)
        k = tl.load(k_base + slots[:, None] * stride_ks + offs_d[None, :])  # (BLOCK_N, D)
        v = tl.load(v_base + slots[:, None] * stride_vs + offs_d[None, :])  # (BLOCK_N, D)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N), unscaled
    if MASKED:
        visible = in_range[None, :]
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= diag + offs_m[:, None])
        if WINDOW:
            visible = visible & (offs_n[None, :] > diag + offs_m[:, None] - window)
        qk = tl.where(visible, qk, float("-inf"))
    # scaled to base 2 inside the exp2 (one FMA a score); qk_scale > 0, so the max commutes with it
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk * qk_scale - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


# kv_start_val is the shared-prefix length of a cascade: a new compile per value divisible by 16 or not
# would land inside a program's first steps, so it is not specialized
@_jit(do_not_specialize=["kv_start_val", "window"])
def _extend_kernel(
    q_ptr, k_ptr, v_ptr, req_to_token_ptr, req_pool_ptr, qo_indptr_ptr, kv_start_ptr, kv_end_ptr, o_ptr, lse_ptr,
    kv_start_val, qk_scale, window,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_rt,
    stride_ot, stride_oh, stride_lt, stride_lh,
    G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    START_TENSOR: tl.constexpr, WRITE_LSE: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_TABLE: tl.constexpr,
    blocks_ptr, REVERSE_M: tl.constexpr = False, WINDOW: tl.constexpr = False,
):
    h = tl.program_id(1)
    if BLOCK_TABLE:  # program i takes the query block blocks[i] = (request, first query); request -1: none
        b = tl.load(blocks_ptr + 2 * tl.program_id(0)).to(tl.int32)
        m0 = tl.load(blocks_ptr + 2 * tl.program_id(0) + 1).to(tl.int32)
        if b < 0:
            return
    elif REVERSE_M:  # the last query blocks (the most keys under a causal mask) first
        b = tl.program_id(0)
        m0 = (tl.num_programs(2) - 1 - tl.program_id(2)) * BLOCK_M
    else:
        b = tl.program_id(0)
        m0 = tl.program_id(2) * BLOCK_M
    q_lo = tl.load(qo_indptr_ptr + b).to(tl.int32)
    n_q = tl.load(qo_indptr_ptr + b + 1).to(tl.int32) - q_lo
    if m0 >= n_q:
        return

    row = tl.load(req_pool_ptr + b).to(tl.int64)
    if START_TENSOR:
        start = tl.load(kv_start_ptr + b).to(tl.int32)
    else:
        start = kv_start_val
    end = tl.load(kv_end_ptr + b).to(tl.int32)

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    row_ok = offs_m < n_q
    tok = (q_lo + offs_m).to(tl.int64)  # (BLOCK_M,) rows of q / out
    q = tl.load(q_ptr + tok[:, None] * stride_qt + h * stride_qh + offs_d[None, :], mask=row_ok[:, None],
                other=0.0)  # (BLOCK_M, D)

    diag = end - n_q  # query j sees keys p <= diag + j (causal)
    if CAUSAL:
        hi = tl.minimum(end, diag + m0 + BLOCK_M)  # past the last key the block's last row sees
        full_hi = tl.minimum(hi, diag + m0 + 1)  # keys below this are seen by every row of the block
    else:
        hi = end
        full_hi = end
    rt = req_to_token_ptr + row * stride_rt
    kvh = h // G
    k_base = k_ptr + kvh * stride_kh
    v_base = v_ptr + kvh * stride_vh
    m_i = tl.full([BLOCK_M], _NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    base = start
    if WINDOW:  # the first row's window begins first; from the last row's start on every row sees the keys
        lo = tl.maximum(start, diag + m0 + 1 - window)
        base = lo + tl.cdiv(tl.maximum(diag + m0 + BLOCK_M - window, lo) - lo, BLOCK_N) * BLOCK_N
        for n0 in range(lo, tl.minimum(base, hi), BLOCK_N):
            acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, n0, rt, k_base, v_base, stride_ks, stride_vs, end,
                                         diag, offs_m, qk_scale, window, D, BLOCK_N, True, CAUSAL, DOT_PRECISION,
                                         True)
    mid = base + tl.maximum(full_hi - base, 0) // BLOCK_N * BLOCK_N  # end of the unmasked tiles
    for n0 in range(base, mid, BLOCK_N):
        acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, n0, rt, k_base, v_base, stride_ks, stride_vs, end, diag,
                                     offs_m, qk_scale, window, D, BLOCK_N, False, CAUSAL, DOT_PRECISION)
    for n0 in range(mid, hi, BLOCK_N):
        acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, n0, rt, k_base, v_base, stride_ks, stride_vs, end, diag,
                                     offs_m, qk_scale, window, D, BLOCK_N, True, CAUSAL, DOT_PRECISION, WINDOW)

    seen = l_i > 0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    tl.store(o_ptr + tok[:, None] * stride_ot + h * stride_oh + offs_d[None, :], o.to(o_ptr.dtype.element_ty),
             mask=row_ok[:, None])
    if WRITE_LSE:
        lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * _LN2, float("-inf"))
        tl.store(lse_ptr + tok * stride_lt + h * stride_lh, lse, mask=row_ok)


INTERPRETED = HAS_TRITON and type(_extend_kernel).__name__ == "InterpretedFunction"
"""Whether the kernels were decorated under TRITON_INTERPRET=1 (then they also run on CPU tensors)."""


def _use_triton(t: torch.Tensor) -> bool:
    return HAS_TRITON and (t.is_cuda or INTERPRETED)


def _check_args(q, k_buf, v_buf, req_to_token, req_pool_indices, qo_indptr, kv_start, kv_end, out,
                lse) -> tuple[int, ...]:
    """Shape/stride/dtype checks at the boundary (metadata only: no device reads). Returns (T, B, H, Hkv, D)."""
    B, H, Hkv, D = check_pool_args(q, k_buf, v_buf, req_to_token, req_pool_indices, kv_start, kv_end)
    T = q.shape[0]
    assert qo_indptr.shape == (B + 1,) and qo_indptr.dtype in (torch.int32, torch.int64), qo_indptr.shape
    assert qo_indptr.device == q.device, (qo_indptr.device, q.device)
    if out is not None:
        assert out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1, (out.shape, out.dtype)
        assert out.device == q.device
    if lse is not None:
        assert lse.shape == (T, H) and lse.dtype == torch.float32 and lse.device == q.device, (lse.shape, lse.dtype)
    return T, B, H, Hkv, D


def extend_attention(
    q: torch.Tensor,  # (T, H, D) the queries of every request, concatenated
    k_buf: torch.Tensor,  # (S, Hkv, D) the layer's K pool; slot 0 is padding
    v_buf: torch.Tensor,  # (S, Hkv, D)
    req_to_token: torch.Tensor,  # (R, C) int32/int64: slot of each position of each request row
    req_pool_indices: torch.Tensor,  # (B,) int: row of req_to_token per request
    qo_indptr: torch.Tensor,  # (B + 1,) int: request i owns rows qo_indptr[i]:qo_indptr[i + 1] of q
    kv_start: int | torch.Tensor,  # python int or (B,) int tensor: first key position
    kv_end: torch.Tensor,  # (B,) int: one past the last key position
    causal: bool,
    scale: float,
    max_q_len: int,  # host int >= every request's query count: sizes the grid (and BLOCK_M)
    out: torch.Tensor | None = None,  # (T, H, D) q.dtype
    lse: torch.Tensor | None = None,  # (T, H) float32
    blocks: torch.Tensor | None = None,  # (NB, 2) int: the query blocks to compute (extend_blocks); see below
    window: int | None = None,  # sliding window (causal only): each query sees its last `window` positions
) -> torch.Tensor:
    """Request i's queries attend to the keys at positions [kv_start(_i), kv_end[i]) of its row, head h on KV
    head h // (H // Hkv). causal=True: query j of n sees positions p <= kv_end[i] - n + j (bottom-right);
    causal=False: every key of the range (a shared prefix: all T queries of a batch as one request over one
    row's first shared_len slots). With a window W, query j sees only p > kv_end[i] - n + j - W.

    Writes out (T, H, D) in q.dtype (allocated if None) and, if given, lse (T, H) float32 natural log; rows that
    see no key get out = 0, lse = -inf; rows of q outside every request's range are not written. Returns out.
    Triton on CUDA tensors (or anywhere under TRITON_INTERPRET=1), else the torch reference. No host syncs on the
    Triton path (CUDA-graph safe).

    blocks: instead of a (B, H, cdiv(max_q_len, BLOCK_M)) grid, one program per row of `blocks` (and head):
    (request, first query row within it), request -1 for none. A CUDA graph captured for a token budget uses it:
    the grid is fixed by the budget, the table (built per replay by extend_blocks, with BLOCK_M =
    extend_block_m(D, max_q_len)) says which blocks exist, and unused rows cost one load each.
    """
    T, B, H, Hkv, D = _check_args(q, k_buf, v_buf, req_to_token, req_pool_indices, qo_indptr, kv_start, kv_end,
                                  out, lse)
    assert scale > 0, scale
    assert window is None or (causal and window > 0), (window, causal)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if not _use_triton(q):
        return extend_attention_ref(q, k_buf, v_buf, req_to_token, req_pool_indices, qo_indptr, kv_start, kv_end,
                                    causal, scale, max_q_len, out=out, lse=lse, window=window)
    if B == 0 or T == 0 or max_q_len <= 0:
        return out
    long = bool(causal) and blocks is None and EXTEND_LONG_TILES is not None and max_q_len >= EXTEND_LONG_MIN
    block_m, block_n, num_warps, num_stages = _extend_config(D, max_q_len, long)
    start_tensor = isinstance(kv_start, torch.Tensor)
    if blocks is not None:
        assert blocks.dim() == 2 and blocks.shape[1] == 2 and blocks.is_contiguous(), blocks.shape
        assert blocks.device == q.device, (blocks.device, q.device)
    grid = (B, H, cdiv(max_q_len, block_m)) if blocks is None else (blocks.shape[0], H, 1)
    _extend_kernel[grid](
        q, k_buf, v_buf, req_to_token, req_pool_indices, qo_indptr, kv_start if start_tensor else kv_end, kv_end,
        out, lse if lse is not None else out,
        0 if start_tensor else int(kv_start), scale * _HOST_LOG2E, int(window or 0),
        q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        req_to_token.stride(0), out.stride(0), out.stride(1),
        *((lse.stride(0), lse.stride(1)) if lse is not None else (0, 0)),
        G=H // Hkv, D=D, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=bool(causal), START_TENSOR=start_tensor,
        WRITE_LSE=lse is not None, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        BLOCK_TABLE=blocks is not None, blocks_ptr=blocks if blocks is not None else qo_indptr,
        REVERSE_M=bool(long and EXTEND_REVERSE), WINDOW=window is not None,
        num_warps=num_warps, num_stages=num_stages)
    return out


def extend_block_m(head_dim: int, max_q_len: int) -> int:
    """The query block size extend_attention uses for this head size and max_q_len in a block-table launch."""
    return _extend_config(head_dim, max_q_len)[0]


def extend_blocks(extend_lens: np.ndarray, block_m: int, capacity: int) -> np.ndarray:
    """(capacity, 2) int64 block table for `blocks`: (request, first query) of every BLOCK_M-query block of
    each request (extend_lens[i] queries), then (-1, 0) rows. Host-side numpy (no device work)."""
    counts = -(-extend_lens // block_m)  # (B,) blocks per request
    n = int(counts.sum())
    assert n <= capacity, (n, capacity)
    table = np.full((capacity, 2), (-1, 0), dtype=np.int64)
    req = np.repeat(np.arange(len(extend_lens)), counts)  # (n,)
    first = np.concatenate([[0], np.cumsum(counts)[:-1]]) if len(counts) else np.zeros(0, np.int64)
    table[:n, 0] = req
    table[:n, 1] = (np.arange(n) - np.repeat(first, counts)) * block_m
    return table


EXTEND_REF_CHUNK = 1 << 22  # score elements (heads x queries x keys) computed at once by the reference


def extend_attention_ref(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_start: int | torch.Tensor,
    kv_end: torch.Tensor,
    causal: bool,
    scale: float,
    max_q_len: int,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """The torch reference of extend_attention (same contract), float32 math, one request (and a chunk of its
    queries) at a time. Reads the index tensors on the host: not CUDA-graph safe."""
    T, B, H, Hkv, D = _check_args(q, k_buf, v_buf, req_to_token, req_pool_indices, qo_indptr, kv_start, kv_end,
                                  out, lse)
    G = H // Hkv
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    qo = qo_indptr.tolist()
    rows = req_pool_indices.tolist()
    ends = kv_end.tolist()
    starts = kv_start.tolist() if isinstance(kv_start, torch.Tensor) else [int(kv_start)] * B
    for i in range(B):
        a, n = qo[i], qo[i + 1] - qo[i]
        assert 0 <= n <= max_q_len, (i, n, max_q_len)
        s, e = starts[i], ends[i]
        nk = max(e - s, 0)
        slots = req_to_token[rows[i], s: s + nk].long()  # (nk,)
        k = k_buf[slots].float()  # (nk, Hkv, D)
        v = v_buf[slots].float()  # (nk, Hkv, D)
        key_pos = torch.arange(s, s + nk, device=q.device)  # (nk,)
        step = max(1, EXTEND_REF_CHUNK // max(1, H * nk))
        for c in range(0, n, step):
            m = min(step, n - c)
            qg = q[a + c: a + c + m].float().view(m, Hkv, G, D)  # (m, Hkv, G, D)
            scores = torch.einsum("mkgd,nkd->kgmn", qg, k) * scale  # (Hkv, G, m, nk)
            if causal:
                q_pos = e - n + c + torch.arange(m, device=q.device)  # (m,) position of each query
                hidden = key_pos[None, :] > q_pos[:, None]  # (m, nk)
                if window is not None:
                    hidden |= key_pos[None, :] <= q_pos[:, None] - window
                scores.masked_fill_(hidden, float("-inf"))
            lse_c = torch.logsumexp(scores, dim=-1)  # (Hkv, G, m); -inf where no key is visible
            probs = torch.exp(scores - lse_c.clamp(min=-1e30).unsqueeze(-1))  # masked keys: exp(-inf) = 0
            o = torch.einsum("kgmn,nkd->mkgd", probs, v)  # (m, Hkv, G, D)
            out[a + c: a + c + m] = o.reshape(m, H, D).to(out.dtype)  # (m, H, D)
            if lse is not None:
                lse[a + c: a + c + m] = lse_c.permute(2, 0, 1).reshape(m, H)  # (m, H)
    return out
