"""Fused mixture-of-experts MLP: each token's top-k experts (SwiGLU MLPs), weighted and summed.

The Triton path sorts the (token, slot) pairs by expert and pads each expert's run to a multiple of BLOCK_M
(`_moe_align_triton`: one kernel; `moe_align` in torch ops for long prefills; neither syncs with the host, so
both are captured in CUDA graphs), then runs one grouped
GEMM kernel twice: gate/up over each block's expert (`w13`), SiLU-and-mul, down (`w2`) with the routing weight
applied to each pair's row, and finally a sum over each token's k rows. A block reads its expert's weights
once for up to BLOCK_M pairs, and only experts some token routes to have blocks: a decode step of one token
reads k experts, not all of them (the blocks past the padded total exit at once).

A call of a few tokens (a decode step at small batch: `use_moe_gemv`) takes two GEMV kernels instead, with no
sorting: per (token, expert) pair its gate and up rows streamed along K with SiLU-and-mul applied, then per token
its experts' down rows, routing weights and sum in one program. At one token the grouped GEMM fills a 16-row
tl.dot tile with one real row and launches three kernels besides its two GEMMs (align, activation, the sum).

`fused_moe_ref` is the torch reference (a loop over the experts that are hit): the CPU path and the oracle.
"""

from __future__ import annotations

import torch

from sgnb.kernels._triton_utils import cdiv, jit, tl, triton, use_triton


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, E) router logits -> top-k weights (T, k) float32 and expert ids (T, k): softmax over all experts in
    float32, the k largest, renormalized to sum 1 when `renormalize` (HF Mixtral / Qwen3-MoE). The Triton
    kernel for CUDA tensors (int32 ids, one launch), else `select_experts_ref` (int64 ids)."""
    if use_triton(router_logits):
        return _select_experts_triton(router_logits, top_k, renormalize)
    return select_experts_ref(router_logits, top_k, renormalize)


def select_experts_ref(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor,
                                                                                             torch.Tensor]:
    probs = torch.softmax(router_logits.float(), dim=-1)  # (T, E)
    weights, ids = torch.topk(probs, top_k, dim=-1)  # (T, k)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


@jit
def _select_experts_kernel(logits_ptr, w_ptr, ids_ptr, E, stride_t, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr,
                           BLOCK_K: tl.constexpr, RENORMALIZE: tl.constexpr):
    # one token: softmax over its E logits, then TOP_K rounds of argmax (taken lanes set to -1)
    t = tl.program_id(0)
    offs = tl.arange(0, BLOCK_E)
    ok = offs < E
    x = tl.load(logits_ptr + t.to(tl.int64) * stride_t + offs, mask=ok, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, 0))
    p = tl.where(ok, p / tl.sum(p, 0), -1.0)
    slots = tl.arange(0, BLOCK_K)
    vals = tl.zeros((BLOCK_K,), dtype=tl.float32)
    ids = tl.zeros((BLOCK_K,), dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, 0)
        idx = tl.argmax(p, 0)
        vals = tl.where(slots == j, best, vals)
        ids = tl.where(slots == j, idx, ids)
        p = tl.where(offs == idx, -1.0, p)
    if RENORMALIZE:
        vals = vals / tl.sum(vals, 0)
    tl.store(w_ptr + t * TOP_K + slots, vals, mask=slots < TOP_K)
    tl.store(ids_ptr + t * TOP_K + slots, ids, mask=slots < TOP_K)


def _select_experts_triton(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor,
                                                                                                torch.Tensor]:
    from sgnb.kernels._triton_utils import next_pow2

    T, E = router_logits.shape
    assert router_logits.stride(1) == 1 and 0 < top_k <= E, (router_logits.stride(), top_k, E)
    weights = torch.empty(T, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int32, device=router_logits.device)
    if T:
        _select_experts_kernel[(T,)](router_logits, weights, ids, E, router_logits.stride(0), TOP_K=top_k,
                                     BLOCK_E=next_pow2(E), BLOCK_K=next_pow2(top_k), RENORMALIZE=renormalize)
    return weights, ids


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """sum_j w_j * down_e(silu(gate_e(x)) * up_e(x)) over each token's k experts e = topk_ids[t, j].
    x (T, H); w13 (E, 2I, H): gate rows then up rows; w2 (E, H, I); topk_* (T, k). Returns (T, H) in x's dtype."""
    T, H = x.shape
    inter = w2.shape[2]
    out = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    for e in topk_ids.unique().tolist():
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)  # the pairs routed to e
        h = x[tok] @ w13[e].t()  # (n, 2I)
        h = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]  # (n, I)
        y = (h @ w2[e].t()) * topk_weights[tok, slot, None].to(x.dtype)  # (n, H)
        out.index_add_(0, tok, y.float())
    return out.to(x.dtype)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                               torch.Tensor]:
    """Pairs sorted by expert, each expert's run padded to a multiple of block_m, for the grouped GEMM.

    Returns sorted_pairs (B * block_m,) int32: pair index (t * k + j) or the sentinel T * k in padding;
    block_expert (B,) int32: each block's expert (num_experts past the end); total (1,) int32: padded length in
    use. B = cdiv(T * k, block_m) + min(E, T * k) bounds the blocks whatever the routing, so every size is
    known from the shapes (no host sync: CUDA-graph safe)."""
    flat = topk_ids.reshape(-1).long()  # (P,)
    P = flat.numel()
    dev = flat.device
    nblocks = cdiv(P, block_m) + min(num_experts, P)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int64))  # (E,)
    padded = (counts + block_m - 1) // block_m * block_m  # (E,)
    pad_end = torch.cumsum(padded, 0)  # (E,)
    order = torch.sort(flat, stable=True).indices  # (P,) pairs grouped by expert
    sorted_e = flat[order]
    rank = torch.arange(P, device=dev) - (torch.cumsum(counts, 0) - counts)[sorted_e]  # place within its expert
    dest = (pad_end - padded)[sorted_e] + rank  # (P,)
    sorted_pairs = torch.full((nblocks * block_m,), P, dtype=torch.int32, device=dev)
    sorted_pairs[dest] = order.to(torch.int32)
    starts = torch.arange(nblocks, device=dev) * block_m
    block_expert = torch.searchsorted(pad_end, starts, right=True).to(torch.int32)  # E past the end
    return sorted_pairs, block_expert, pad_end[-1:].to(torch.int32)


@jit
def _moe_align_kernel(ids_ptr, pairs_ptr, block_expert_ptr, total_ptr, cursor_ptr, P, E, nblocks,
                      BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_B: tl.constexpr):
    # one program: count pairs per expert, pad the runs to BLOCK_M, place each pair at its expert's cursor
    # (an atomic increment: the order inside a run is arbitrary, which the GEMMs do not mind), then each
    # block's expert. BLOCK_E > E: the spare bin takes the masked lanes.
    offs_p = tl.arange(0, BLOCK_P)
    p_ok = offs_p < P
    for f0 in range(0, nblocks * BLOCK_M, BLOCK_P):  # every slot starts as padding (the sentinel P)
        tl.store(pairs_ptr + f0 + offs_p, P + 0 * offs_p, mask=f0 + offs_p < nblocks * BLOCK_M)
    ids = tl.load(ids_ptr + offs_p, mask=p_ok, other=BLOCK_E - 1).to(tl.int32)
    offs_e = tl.arange(0, BLOCK_E)
    e_ok = offs_e < E
    counts = tl.where(e_ok, tl.histogram(ids, BLOCK_E), 0)  # (BLOCK_E,)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    pad_end = tl.cumsum(padded, 0)
    tl.store(cursor_ptr + offs_e, pad_end - padded)
    tl.store(total_ptr, tl.sum(padded, 0))
    tl.debug_barrier()  # the cursors and the padding are in memory before any thread places a pair
    dest = tl.atomic_add(cursor_ptr + ids, 1, mask=p_ok)
    tl.store(pairs_ptr + dest, offs_p, mask=p_ok)
    for b0 in range(0, nblocks, BLOCK_B):
        offs_b = b0 + tl.arange(0, BLOCK_B)
        before = (pad_end[None, :] <= (offs_b * BLOCK_M)[:, None]) & e_ok[None, :]  # (BLOCK_B, BLOCK_E)
        tl.store(block_expert_ptr + offs_b, tl.sum(before.to(tl.int32), 1), mask=offs_b < nblocks)


ALIGN_MAX_PAIRS = 4096  # one program of _moe_align_kernel holds every pair; more (long prefills): moe_align


def _moe_align_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                                       torch.Tensor]:
    """moe_align's contract in two launches (a fill and one kernel), for up to ALIGN_MAX_PAIRS pairs; the pairs
    of one expert's run may come in any order."""
    from sgnb.kernels._triton_utils import next_pow2

    flat = topk_ids.reshape(-1)  # (P,) int32 from the Triton router (an int64 input is read as such)
    P = flat.numel()
    assert 0 < P <= ALIGN_MAX_PAIRS, P
    nblocks = cdiv(P, block_m) + min(num_experts, P)
    dev = flat.device
    sorted_pairs = torch.empty(nblocks * block_m, dtype=torch.int32, device=dev)
    block_expert = torch.empty(nblocks, dtype=torch.int32, device=dev)
    total = torch.empty(1, dtype=torch.int32, device=dev)
    block_e = next_pow2(num_experts + 1)
    cursor = torch.empty(block_e, dtype=torch.int32, device=dev)
    _moe_align_kernel[(1,)](flat, sorted_pairs, block_expert, total, cursor, P, num_experts, nblocks,
                            BLOCK_P=next_pow2(P), BLOCK_E=block_e, BLOCK_M=block_m, BLOCK_B=16)
    return sorted_pairs, block_expert, total


@jit
def _moe_gemm_kernel(a_ptr, w_ptr, c_ptr, weight_ptr, pairs_ptr, block_expert_ptr, total_ptr,
                     N, K, num_pairs, a_div, stride_am, stride_we, stride_wn, stride_cm,
                     MUL_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):
    # one (BLOCK_M pairs of one expert) x (BLOCK_N output columns) tile: C[pair] = A[pair // a_div] @ W[e]^T
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return  # a block past the routed experts' runs: reads nothing
    e = tl.load(block_expert_ptr + pid_m)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pairs_ptr + offs_m)  # (BM,)
    valid = pair < num_pairs
    row = pair // a_div
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + row[:, None].to(tl.int64) * stride_am  # (BM, 1)
    w_cols = w_ptr + e.to(tl.int64) * stride_we + offs_n[None, :].to(tl.int64) * stride_wn  # (1, BN)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + offs_k) < K
        a = tl.load(a_rows + (k0 + offs_k)[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)  # (BM, BK)
        w = tl.load(w_cols + (k0 + offs_k)[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # (BK, BN)
        acc += tl.dot(a, w)
    if MUL_WEIGHT:
        acc *= tl.load(weight_ptr + pair, mask=valid, other=0.0)[:, None]
    c = c_ptr + pair[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


def _moe_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, pair_weights: torch.Tensor | None,
              sorted_pairs: torch.Tensor, block_expert: torch.Tensor, total: torch.Tensor, a_div: int,
              block_m: int) -> None:
    E, N, K = w.shape
    assert a.shape[1] == K and a.stride(1) == 1 and w.stride(2) == 1 and out.stride(1) == 1, (a.shape, w.shape)
    assert out.shape[1] == N and a.dtype == w.dtype == out.dtype, (out.shape, a.dtype, w.dtype, out.dtype)
    block_n, block_k = 64, 64 if K >= 64 else max(16, 1 << (K - 1).bit_length())
    grid = (block_expert.numel(), cdiv(N, block_n))
    _moe_gemm_kernel[grid](a, w, out, pair_weights if pair_weights is not None else out, sorted_pairs,
                           block_expert, total, N, K, out.shape[0], a_div, a.stride(0), w.stride(0), w.stride(1),
                           out.stride(0), MUL_WEIGHT=pair_weights is not None, BLOCK_M=block_m, BLOCK_N=block_n,
                           BLOCK_K=block_k)


def _block_m(pairs: int, num_experts: int) -> int:
    """Rows of a block: 16 (tl.dot's least) while experts see few pairs each (decode), more when many do."""
    per_expert = pairs / num_experts
    return 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64


# ---- few tokens (decode): one GEMV per (token, expert) pair ---------------------------------------------------
@jit
def _moe_gemv_up_kernel(x_ptr, w_ptr, act_ptr, ids_ptr, INTER, K, stride_x, stride_we, stride_wn, stride_act,
                        TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # act[p, n] = silu(x[t] . w13[e, n]) * (x[t] . w13[e, INTER + n]) for pair p = t * TOP_K + j, e = ids[p]: the
    # program streams BLOCK_N gate rows and the matching up rows of its expert along K, where they are
    # contiguous, into (BLOCK_N, BLOCK_K) float32 accumulators summed over K once at the end
    p = tl.program_id(0)
    e = tl.load(ids_ptr + p).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < INTER
    offs_k = tl.arange(0, BLOCK_K)
    x_row = x_ptr + (p // TOP_K).to(tl.int64) * stride_x
    gate_rows = w_ptr + e * stride_we + offs_n[:, None].to(tl.int64) * stride_wn  # (BN, 1)
    up_rows = gate_rows + INTER * stride_wn
    acc_g = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < K
        xk = tl.load(x_row + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]  # (1, BK)
        mask = n_ok[:, None] & k_ok[None, :]
        acc_g += tl.load(gate_rows + k[None, :], mask=mask, other=0.0).to(tl.float32) * xk
        acc_u += tl.load(up_rows + k[None, :], mask=mask, other=0.0).to(tl.float32) * xk
    g = tl.sum(acc_g, axis=1)
    u = tl.sum(acc_u, axis=1)
    act = g / (1.0 + tl.exp(-g)) * u
    tl.store(act_ptr + p.to(tl.int64) * stride_act + offs_n, act.to(act_ptr.dtype.element_ty), mask=n_ok)


@jit
def _moe_gemv_down_kernel(act_ptr, w_ptr, y_ptr, ids_ptr, weights_ptr, H, K, stride_act, stride_we, stride_wn,
                          stride_y, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # y[t, n] = sum_j weights[t, j] * (act[t * TOP_K + j] . w2[ids[t, j], n]): the down projections of a token's
    # TOP_K experts, their routing weights and their sum in one program per (token, BLOCK_N output columns)
    t = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    out = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j in range(TOP_K):
        p = t * TOP_K + j
        e = tl.load(ids_ptr + p).to(tl.int64)
        rows = w_ptr + e * stride_we + offs_n[:, None].to(tl.int64) * stride_wn  # (BN, 1)
        a_row = act_ptr + p.to(tl.int64) * stride_act
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + offs_k
            k_ok = k < K
            a = tl.load(a_row + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]  # (1, BK)
            acc += tl.load(rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32) * a
        out += tl.load(weights_ptr + p) * tl.sum(acc, axis=1)
    tl.store(y_ptr + t.to(tl.int64) * stride_y + offs_n, out.to(y_ptr.dtype.element_ty), mask=n_ok)


# (BLOCK_N, BLOCK_K, num_warps) of the two GEMV kernels: the fastest of `bench_moe_fp8.py --parts moe_gemv`'s
# sweep at one token on an H100 (2026-12-07, a Qwen3-30B-A3B layer, weights read from HBM;
# benchmarks/results/2026-12-07-gpu-moe-gemv.json; times of both kernels together): the up tiles swept beside
# down at (8, 512, 4): 0.0430 ms for this one against 0.0437-0.0472; then the down tiles beside this up tile:
# 0.0353 ms against 0.0366-0.0775
GEMV_TILES = {"up": (16, 256, 4), "down": (4, 1024, 8)}


def use_moe_gemv(tokens: int, num_experts: int, top_k: int) -> bool:
    """Whether a call of `tokens` tokens takes the GEMV kernels: one token, or so few pairs that the tokens'
    experts rarely coincide (each pair reads its expert's weights itself; the grouped GEMM reads a shared expert
    once). Same H100 run, 128 experts, top 8: GEMV / grouped time 0.83x at one token, 0.98x at two, 1.04x at
    four, 1.13x at eight."""
    return tokens == 1 or tokens * top_k * 8 <= num_experts


def _fused_moe_gemv(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, tiles: dict[str, tuple[int, int, int]] | None = None) -> torch.Tensor:
    """fused_moe for few tokens in two launches, no sorting: gate/up with SiLU-and-mul per pair, then per token
    its experts' down projections, weighted and summed. `tiles` overrides GEMV_TILES (the benchmark's sweep)."""
    T, H = x.shape
    E, two_i, _ = w13.shape
    inter, k = two_i // 2, topk_ids.shape[1]
    tiles = {**GEMV_TILES, **(tiles or {})}
    assert w13.stride(2) == w2.stride(2) == 1, "expert rows must be contiguous along K"
    x = x.contiguous()
    ids = topk_ids.reshape(-1).contiguous()
    weights = topk_weights.reshape(-1).float().contiguous()
    act = torch.empty(T * k, inter, dtype=x.dtype, device=x.device)  # (P, I), row = pair
    y = torch.empty(T, H, dtype=x.dtype, device=x.device)
    if T:
        bn, bk, warps = tiles["up"]
        _moe_gemv_up_kernel[(T * k, cdiv(inter, bn))](x, w13, act, ids, inter, H, x.stride(0), w13.stride(0),
                                                      w13.stride(1), act.stride(0), TOP_K=k, BLOCK_N=bn,
                                                      BLOCK_K=bk, num_warps=warps)
        bn, bk, warps = tiles["down"]
        _moe_gemv_down_kernel[(T, cdiv(H, bn))](act, w2, y, ids, weights, H, inter, act.stride(0), w2.stride(0),
                                                w2.stride(1), y.stride(0), TOP_K=k, BLOCK_N=bn, BLOCK_K=bk,
                                                num_warps=warps)
    return y


def _fused_moe_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, block_m: int | None = None, gemv: bool | None = None) -> torch.Tensor:
    """The Triton fused MoE: the GEMV kernels for few tokens (use_moe_gemv), else the grouped GEMM (block_m
    rows a block); `gemv` forces one or the other."""
    from sgnb.kernels.activation import silu_and_mul

    assert triton is not None
    T, H = x.shape
    E, two_i, _ = w13.shape
    k = topk_ids.shape[1]
    assert w13.shape[2] == H and w2.shape == (E, H, two_i // 2), (x.shape, w13.shape, w2.shape)
    assert topk_ids.shape == topk_weights.shape == (T, k), (topk_ids.shape, topk_weights.shape)
    if gemv if gemv is not None else use_moe_gemv(T, E, k):
        return _fused_moe_gemv(x, w13, w2, topk_weights, topk_ids)
    bm = block_m or _block_m(T * k, E)
    align = _moe_align_triton if T * k <= ALIGN_MAX_PAIRS else moe_align
    sorted_pairs, block_expert, total = align(topk_ids, E, bm)
    x = x.contiguous()
    gate_up = torch.empty(T * k, two_i, dtype=x.dtype, device=x.device)  # (P, 2I), row = pair
    _moe_gemm(x, w13, gate_up, None, sorted_pairs, block_expert, total, k, bm)
    act = silu_and_mul(gate_up)  # (P, I)
    down = torch.empty(T * k, H, dtype=x.dtype, device=x.device)  # (P, H)
    weights = topk_weights.reshape(-1).float().contiguous()  # (P,)
    _moe_gemm(act, w2, down, weights, sorted_pairs, block_expert, total, 1, bm)
    return down.view(T, k, H).sum(dim=1)  # (T, H); torch accumulates bf16 sums in float32


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """The Triton kernel for CUDA tensors, else the torch reference (see fused_moe_ref for the contract)."""
    if use_triton(x):
        return _fused_moe_triton(x, w13, w2, topk_weights, topk_ids)
    return fused_moe_ref(x, w13, w2, topk_weights, topk_ids)
