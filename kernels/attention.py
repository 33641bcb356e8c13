"""Attention over a paged KV pool (page size 1): the torch reference used on CPU and as the oracle.

Layout: the pool holds K and V per layer as (num_slots, num_kv_heads, head_dim). A request's tokens live at
arbitrary slots listed in `req_to_token[req_pool_index, :seq_len]`. Callers write the new tokens' K/V into the
pool before calling, so a request attends to its cached prefix and its own new tokens alike.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def paged_attention_ref(
    q: torch.Tensor,  # (T, H, D) queries of the new tokens of every request, concatenated
    k_buf: torch.Tensor,  # (S, Hkv, D)
    v_buf: torch.Tensor,  # (S, Hkv, D)
    req_to_token: torch.Tensor,  # (R, max_context) int
    req_pool_indices: list[int],
    prefix_lens: list[int],  # tokens already in the pool before this step (cached or previously computed)
    extend_lens: list[int],  # new tokens per request; their queries are consecutive in q
    scale: float,
    shared_len: int = 0,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of each request's new tokens over its prefix + itself. Returns (T, H, D).

    window W: each query sees only its own position and the W - 1 before it (a sliding-window layer; the
    keys before the first query's window are not even gathered). shared_len is then ignored.

    shared_len > 0 says every request's first shared_len slots are the same (a prefix shared through the
    radix cache, shared_len <= every prefix_len): its K/V is then read once for the whole batch (cascade
    attention) and merged with each request's own part by log-sum-exp, instead of once per request.
    """
    if shared_len > 0 and window is None:
        return _cascade_attention(q, k_buf, v_buf, req_to_token, req_pool_indices, prefix_lens, extend_lens,
                                  scale, shared_len)
    T, H, D = q.shape
    Hkv = k_buf.shape[1]
    assert H % Hkv == 0 and k_buf.shape == v_buf.shape and k_buf.shape[2] == D
    assert sum(extend_lens) == T and len(req_pool_indices) == len(prefix_lens) == len(extend_lens)
    out = torch.empty_like(q)
    start = 0
    for rp, prefix, ext in zip(req_pool_indices, prefix_lens, extend_lens):
        seq = prefix + ext
        first = 0 if window is None else max(0, prefix + 1 - window)  # the first key any query sees
        slots = req_to_token[rp, first:seq]
        k = k_buf.index_select(0, slots).transpose(0, 1)  # (Hkv, seq - first, D)
        v = v_buf.index_select(0, slots).transpose(0, 1)  # (Hkv, seq - first, D)
        qi = q[start : start + ext].transpose(0, 1)  # (H, ext, D)
        causal = False
        if window is not None and ext > 1:
            q_pos = torch.arange(ext, device=q.device).unsqueeze(1) + prefix  # (ext, 1)
            key_pos = torch.arange(first, seq, device=q.device).unsqueeze(0)  # (1, seq - first)
            mask = (key_pos <= q_pos) & (key_pos > q_pos - window)  # (ext, seq - first)
        elif ext == 1:
            mask = None  # a single query sees every key
        elif prefix == 0:
            mask, causal = None, True  # square: SDPA's own (top-left) causal mask is the right one
        else:
            # query i (absolute position prefix + i) sees keys 0..prefix + i
            rows = torch.arange(ext, device=q.device).unsqueeze(1) + prefix
            mask = torch.arange(seq, device=q.device).unsqueeze(0) <= rows  # (ext, seq)
        o = F.scaled_dot_product_attention(
            qi.unsqueeze(0), k.unsqueeze(0).to(q.dtype), v.unsqueeze(0).to(q.dtype),
            attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=Hkv != H,
        )  # (1, H, ext, D)
        out[start : start + ext] = o[0].transpose(0, 1)
        start += ext
    return out


def dense_causal_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Plain causal attention for one sequence, (T, H, D) x (T, Hkv, D) -> (T, H, D): the naive oracle."""
    H, Hkv = q.shape[1], k.shape[1]
    k = k.repeat_interleave(H // Hkv, dim=1)
    v = v.repeat_interleave(H // Hkv, dim=1)
    scores = torch.einsum("thd,shd->hts", q.float(), k.float()) * scale  # (H, T, S)
    T = q.shape[0]
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(-1), v.float()).to(q.dtype)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped-query attention with its log-sum-exp. q (..., Hkv, G, Tq, D); k, v (..., Hkv, S, D);
    mask broadcastable to (..., Hkv, G, Tq, S), True = attend. Returns out (..., Hkv, G, Tq, D) normalized
    and lse (..., Hkv, G, Tq); rows with no visible key get lse = -inf and out = 0."""
    *lead, Hkv, G, Tq, D = q.shape
    if mask is None and not lead and q.device.type == "cpu":  # torch's CPU flash kernel also returns the lse
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.reshape(1, Hkv, G * Tq, D), k.unsqueeze(0).to(q.dtype), v.unsqueeze(0).to(q.dtype), 0.0, False,
            scale=scale)[:2]
        return out.float().view(Hkv, G, Tq, D), lse.view(Hkv, G, Tq)
    # the G query heads of a KV head share its keys: fold them into the query rows, so the matmuls read K and
    # V as they are (broadcasting k over G would copy it G times)
    rows = q.float().reshape(*lead, Hkv, G * Tq, D)
    scores = torch.matmul(rows, k.float().transpose(-1, -2)).mul_(scale)  # (..., Hkv, G * Tq, S)
    scores = scores.view(*lead, Hkv, G, Tq, scores.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (..., Hkv, G, Tq)
    probs = torch.exp(scores - lse.unsqueeze(-1).clamp(min=-1e30)).nan_to_num_(0.0)
    out = torch.matmul(probs.view(*lead, Hkv, G * Tq, -1), v.float())  # (..., Hkv, G * Tq, D)
    return out.view(*lead, Hkv, G, Tq, D), lse


def _merge(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor) -> torch.Tensor:
    """Combine two attention partials over disjoint key sets (normalized outputs + their log-sum-exps)."""
    lse = torch.logaddexp(lse1, lse2)
    w1, w2 = torch.exp(lse1 - lse).unsqueeze(-1), torch.exp(lse2 - lse).unsqueeze(-1)
    return o1 * w1 + o2 * w2


attend_with_lse = _attend  # public names for backends that assemble attention from these pieces
merge_partials = _merge

DECODE_CHUNK_SLOTS = 1 << 16  # padded (request, key) pairs gathered at once: bounds the temporary K/V copies


def _decode_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, req_to_token: torch.Tensor,
                      req_pool_indices: list[int], start: int, lens: list[int],
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One query per request (q: (B, H, D)) over that request's keys start .. start + lens[i], gathered into a
    padded (B, S) batch: a few tensor ops for the whole batch instead of a handful per request. Returns
    out (Hkv, G, B, D) normalized and lse (Hkv, G, B)."""
    B, H, D = q.shape
    Hkv = k_buf.shape[1]
    G = H // Hkv
    outs, lses = [], []
    step = max(1, DECODE_CHUNK_SLOTS // max(lens))
    for c in range(0, B, step):
        own = torch.tensor(lens[c: c + step], device=q.device)  # (b,)
        cols = start + torch.arange(int(own.max()), device=q.device)  # (S,)
        visible = cols.unsqueeze(0) - start < own.unsqueeze(1)  # (b, S); padding reads slot 0 (zeros)
        rows = torch.tensor(req_pool_indices[c: c + step], device=q.device)
        idx = torch.where(visible, req_to_token[rows.unsqueeze(1), cols], 0)
        k, v = k_buf[idx].permute(0, 2, 1, 3), v_buf[idx].permute(0, 2, 1, 3)  # (b, Hkv, S, D)
        o, lse = _attend(q[c: c + step].view(-1, Hkv, G, 1, D), k, v, scale, visible[:, None, None, None, :])
        outs.append(o.squeeze(3))  # (b, Hkv, G, D)
        lses.append(lse.squeeze(3))  # (b, Hkv, G)
    return torch.cat(outs).permute(1, 2, 0, 3), torch.cat(lses).permute(1, 2, 0)


def _cascade_attention(q, k_buf, v_buf, req_to_token, req_pool_indices, prefix_lens, extend_lens, scale,
                       shared_len):
    T, H, D = q.shape
    Hkv = k_buf.shape[1]
    G = H // Hkv
    assert 0 < shared_len <= min(prefix_lens), (shared_len, min(prefix_lens))
    # shared part: all T queries against the common prefix, no mask (every query comes after it)
    slots = req_to_token[req_pool_indices[0], :shared_len]
    k = k_buf.index_select(0, slots).permute(1, 0, 2)  # (Hkv, L, D)
    v = v_buf.index_select(0, slots).permute(1, 0, 2)  # (Hkv, L, D)
    qg = q.view(T, Hkv, G, D).permute(1, 2, 0, 3)  # (Hkv, G, T, D)
    o1, lse1 = _attend(qg, k, v, scale, None)  # (Hkv, G, T, D), (Hkv, G, T)

    if all(e == 1 for e in extend_lens):  # decode: each request's own keys, padded into one batch
        o2, lse2 = _decode_attention(q, k_buf, v_buf, req_to_token, req_pool_indices, shared_len,
                                     [p + 1 - shared_len for p in prefix_lens], scale)
    else:  # extend: per request, causal over its own keys after the shared prefix
        o2 = torch.empty_like(o1)
        lse2 = torch.empty_like(lse1)
        start = 0
        for rp, prefix, ext in zip(req_pool_indices, prefix_lens, extend_lens):
            own = prefix + ext - shared_len
            s2 = req_to_token[rp, shared_len: shared_len + own]
            k2 = k_buf.index_select(0, s2).permute(1, 0, 2)  # (Hkv, own, D)
            v2 = v_buf.index_select(0, s2).permute(1, 0, 2)
            rows = torch.arange(ext, device=q.device).unsqueeze(1) + (prefix - shared_len)
            mask = torch.arange(own, device=q.device).unsqueeze(0) <= rows  # (ext, own)
            oi, li = _attend(qg[:, :, start: start + ext], k2, v2, scale, mask)
            o2[:, :, start: start + ext], lse2[:, :, start: start + ext] = oi, li
            start += ext
    out = _merge(o1, lse1, o2, lse2)  # (Hkv, G, T, D)
    return out.permute(2, 0, 1, 3).reshape(T, H, D).to(q.dtype)
