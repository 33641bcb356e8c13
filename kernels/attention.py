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
) -> torch.Tensor:
    """Causal attention of each request's new tokens over its prefix + itself. Returns (T, H, D)."""
    T, H, D = q.shape
    Hkv = k_buf.shape[1]
    assert H % Hkv == 0 and k_buf.shape == v_buf.shape and k_buf.shape[2] == D
    assert sum(extend_lens) == T and len(req_pool_indices) == len(prefix_lens) == len(extend_lens)
    out = torch.empty_like(q)
    start = 0
    for rp, prefix, ext in zip(req_pool_indices, prefix_lens, extend_lens):
        seq = prefix + ext
        slots = req_to_token[rp, :seq]
        k = k_buf.index_select(0, slots).transpose(0, 1)  # (Hkv, seq, D)
        v = v_buf.index_select(0, slots).transpose(0, 1)  # (Hkv, seq, D)
        qi = q[start : start + ext].transpose(0, 1)  # (H, ext, D)
        causal = False
        if ext == 1:
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
