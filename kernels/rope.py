"""Rotary position embedding (rotate-half layout, as in HF Llama): the tables, the torch reference, and an
in-place Triton kernel that rotates q and k of a batch in one launch."""

from __future__ import annotations

import math

import torch

from ._triton_utils import jit, next_pow2, tl, use_triton


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies (head_dim // 2,), float32, with Llama-3 style scaling when asked for."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling and scaling.get("rope_type", scaling.get("type")) == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_ctx = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        scaled = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
        inv = scaled
    elif scaling and scaling.get("rope_type", scaling.get("type")) == "linear":
        inv = inv / scaling["factor"]
    return inv.float()


def rope_cos_sin(inv_freq: torch.Tensor, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape (P, D/2): the two halves of a head share their angles."""
    t = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq.float())  # (P, D/2)
    return freqs.cos(), freqs.sin()


def apply_rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, H, D); cos/sin (T, D/2) gathered at the tokens' positions. Rotate-half layout: the pairs are
    (x[i], x[i + D/2]), i.e. out = x * [cos, cos] + [-x2, x1] * [sin, sin]."""
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]  # (T, H, D/2) each
    c, s = cos[:, None, :], sin[:, None, :]  # (T, 1, D/2)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


def apply_rope_inplace_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                           sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """apply_rope's contract through apply_rope_ref: q and k rotated in place at their tokens' positions."""
    c, s = cos[positions], sin[positions]  # (T, D/2)
    q.copy_(apply_rope_ref(q, c, s))
    k.copy_(apply_rope_ref(k, c, s))
    return q, k


@jit
def _rotate_heads(base, head_stride, n_heads, HALF, c, s, d, d_mask, BLOCK_H: tl.constexpr):
    """Rotate the n_heads heads of one token at base in place; c, s (1, BLOCK_HALF) fp32."""
    h = tl.arange(0, BLOCK_H)
    offs = h[:, None] * head_stride + d[None, :]  # (BLOCK_H, BLOCK_HALF): the first half of each head
    mask = (h[:, None] < n_heads) & d_mask[None, :]
    x1 = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + offs + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(base + offs, (x1 * c - x2 * s).to(base.dtype.element_ty), mask=mask)
    tl.store(base + offs + HALF, (x2 * c + x1 * s).to(base.dtype.element_ty), mask=mask)


@jit
def _rope_kernel(q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr, q_stride_t, q_stride_h, k_stride_t, k_stride_h,
                 cos_stride, H, HKV, HALF,
                 BLOCK_H: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr):
    # one program per token: its position's angles are loaded once for all q and k heads
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    d_mask = d < HALF
    c = tl.load(cos_ptr + pos * cos_stride + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]  # (1, BLOCK_HALF)
    s = tl.load(sin_ptr + pos * cos_stride + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]  # (1, BLOCK_HALF)
    _rotate_heads(q_ptr + t * q_stride_t, q_stride_h, H, HALF, c, s, d, d_mask, BLOCK_H)
    _rotate_heads(k_ptr + t * k_stride_t, k_stride_h, HKV, HALF, c, s, d, d_mask, BLOCK_HKV)


def _apply_rope_triton(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    assert q.dim() == 3 and k.dim() == 3, (q.shape, k.shape)
    T, H, D = q.shape
    Hkv = k.shape[1]
    assert k.shape == (T, Hkv, D) and D % 2 == 0, (q.shape, k.shape)
    assert q.stride(2) == 1 and k.stride(2) == 1, f"head dim must be contiguous: {q.stride()}, {k.stride()}"
    assert positions.shape == (T,) and not positions.is_floating_point() and positions.stride(0) == 1, (
        positions.shape, positions.dtype)
    assert cos.dim() == 2 and cos.shape[1] == D // 2 and sin.shape == cos.shape, (cos.shape, sin.shape, D)
    assert cos.stride() == sin.stride() and cos.stride(1) == 1, (cos.stride(), sin.stride())
    assert q.device == k.device == positions.device == cos.device == sin.device
    if T == 0:
        return q, k
    BLOCK_H, BLOCK_HKV, BLOCK_HALF = next_pow2(H), next_pow2(Hkv), next_pow2(D // 2)
    _rope_kernel[(T,)](q, k, positions, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                       cos.stride(0), H, Hkv, D // 2, BLOCK_H=BLOCK_H, BLOCK_HKV=BLOCK_HKV, BLOCK_HALF=BLOCK_HALF,
                       num_warps=min(max(BLOCK_H * BLOCK_HALF // 512, 1), 8))
    return q, k


_cpu_cache: list = [None, None]  # (cos, sin, full-width tables), (positions, their values, tables, rows)


def _apply_rope_cpu(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """apply_rope_ref's math in a few in-place ops (the CPU's decode steps pay per op, ~30 layers x 2 calls):
    x * [cos, cos] + roll(x, D/2) * [-sin, sin], with the full-width tables built once per (cos, sin) and
    gathered once per positions tensor (every layer of a forward passes the same one; one changed in place is
    gathered again); q and k rotated as one view when k follows q in memory (a fused qkv output)."""
    tables = _cpu_cache[0]
    if tables is None or tables[0] is not cos or tables[1] is not sin:
        tables = _cpu_cache[0] = (cos, sin, torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1))  # (P, D)
    last = _cpu_cache[1]
    if last is None or last[0] is not positions or last[2] is not tables or not torch.equal(last[1], positions):
        last = _cpu_cache[1] = (positions, positions.clone(), tables, tables[2][positions].unsqueeze(1),
                                tables[3][positions].unsqueeze(1))  # (T, 1, D) each
    c, s = last[3], last[4]
    T, H, D = q.shape
    joint = (q.stride() == k.stride() and q.stride(1) == D and q.dtype == k.dtype
             and k.data_ptr() == q.data_ptr() + H * D * q.element_size())
    for x in [q.as_strided((T, H + k.shape[1], D), q.stride())] if joint else [q, k]:
        rot = x.roll(D // 2, dims=-1)  # [x2, x1], a copy
        x.mul_(c).addcmul_(rot, s)
    return q, k


def apply_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q (T, H, D) and k (T, Hkv, D) IN PLACE at positions (T,) int; returns (q, k).

    q and k may be strided views (e.g. of a fused qkv output) with a contiguous last dim. cos/sin (P, D/2) are
    rope_cos_sin's float32 tables; positions must be < P (not checked: that would sync the GPU). Rotate-half
    layout, float32 math, apply_rope_ref's (to rounding). Triton on CUDA (one launch); on CPU for float32 our C
    kernel (native.rope) or the same math in a few in-place ops (`_apply_rope_cpu`), apply_rope_inplace_ref
    otherwise.
    """
    if use_triton(q):
        return _apply_rope_triton(q, k, positions, cos, sin)
    if q.device.type == "cpu" and q.dtype == k.dtype == torch.float32 and q.stride(-1) == k.stride(-1) == 1:
        from . import native

        D = q.shape[-1]
        if (q.stride(1) == k.stride(1) == D and cos.dtype == sin.dtype == torch.float32 and cos.is_contiguous()
                and sin.is_contiguous() and native.available()):  # our kernel: one pass over the rows
            native.rope(q, k, positions, cos, sin)
            return q, k
        return _apply_rope_cpu(q, k, positions, cos, sin)
    return apply_rope_inplace_ref(q, k, positions, cos, sin)


@jit
def _rope_store_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, loc_ptr, kb_ptr, vb_ptr,
                       q_stride_t, q_stride_h, k_stride_t, k_stride_h, v_stride_t, v_stride_h,
                       kb_stride_s, kb_stride_h, vb_stride_s, vb_stride_h, cos_stride, H, HKV, HALF,
                       BLOCK_H: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr):
    # one program per token: rotate its q heads in place, rotate its k heads (in place and into the pool at
    # the token's slot), copy its v heads into the pool; _rope_kernel + _store_kv_kernel in one launch
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    slot = tl.load(loc_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    d_mask = d < HALF
    c = tl.load(cos_ptr + pos * cos_stride + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]  # (1, BLOCK_HALF)
    s = tl.load(sin_ptr + pos * cos_stride + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    _rotate_heads(q_ptr + t * q_stride_t, q_stride_h, H, HALF, c, s, d, d_mask, BLOCK_H)
    h = tl.arange(0, BLOCK_HKV)[:, None]
    mask = (h < HKV) & d_mask[None, :]  # (BLOCK_HKV, BLOCK_HALF)
    k_src = k_ptr + t * k_stride_t + h * k_stride_h + d[None, :]
    x1 = tl.load(k_src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(k_src + HALF, mask=mask, other=0.0).to(tl.float32)
    r1 = (x1 * c - x2 * s).to(k_ptr.dtype.element_ty)
    r2 = (x2 * c + x1 * s).to(k_ptr.dtype.element_ty)
    tl.store(k_src, r1, mask=mask)
    tl.store(k_src + HALF, r2, mask=mask)
    k_dst = kb_ptr + slot * kb_stride_s + h * kb_stride_h + d[None, :]
    tl.store(k_dst, r1.to(kb_ptr.dtype.element_ty), mask=mask)
    tl.store(k_dst + HALF, r2.to(kb_ptr.dtype.element_ty), mask=mask)
    v_src = v_ptr + t * v_stride_t + h * v_stride_h + d[None, :]
    v_dst = vb_ptr + slot * vb_stride_s + h * vb_stride_h + d[None, :]
    tl.store(v_dst, tl.load(v_src, mask=mask).to(vb_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst + HALF, tl.load(v_src + HALF, mask=mask).to(vb_ptr.dtype.element_ty), mask=mask)


def apply_rope_and_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                         cos: torch.Tensor, sin: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                         loc: torch.Tensor) -> None:
    """apply_rope(q, k, positions, cos, sin) then store_kv(k_buf, v_buf, loc, k, v), in one launch on CUDA: q
    and k rotated IN PLACE, the rotated k and v written at slots loc (T,) of the pool (S, Hkv, D). The same
    contracts as those two (strided views with a contiguous last dim; positions < P and distinct loc not
    checked); elsewhere it runs those two."""
    if not use_triton(q):
        from .kv_store import store_kv

        apply_rope(q, k, positions, cos, sin)
        store_kv(k_buf, v_buf, loc, k, v)
        return
    T, H, D = q.shape
    Hkv = k.shape[1]
    assert q.dim() == 3 and k.shape == (T, Hkv, D) and v.shape == k.shape and D % 2 == 0, (q.shape, k.shape, v.shape)
    assert q.stride(2) == k.stride(2) == v.stride(2) == 1, f"head dim must be contiguous: {q.stride()}, {k.stride()}"
    assert k_buf.dim() == 3 and k_buf.shape[1:] == (Hkv, D) and v_buf.shape == k_buf.shape, (k_buf.shape, k.shape)
    assert k_buf.stride(2) == v_buf.stride(2) == 1, "the pool's head dim must be contiguous"
    for idx in (positions, loc):
        assert idx.shape == (T,) and not idx.is_floating_point() and idx.stride(0) == 1, (idx.shape, idx.dtype)
    assert cos.dim() == 2 and cos.shape[1] == D // 2 and sin.shape == cos.shape, (cos.shape, sin.shape, D)
    assert cos.stride() == sin.stride() and cos.stride(1) == 1, (cos.stride(), sin.stride())
    assert q.device == k.device == v.device == positions.device == cos.device == k_buf.device == loc.device
    if T == 0:
        return
    BLOCK_H, BLOCK_HKV, BLOCK_HALF = next_pow2(H), next_pow2(Hkv), next_pow2(D // 2)
    _rope_store_kernel[(T,)](q, k, v, positions, cos, sin, loc, k_buf, v_buf, q.stride(0), q.stride(1), k.stride(0),
                             k.stride(1), v.stride(0), v.stride(1), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0),
                             v_buf.stride(1), cos.stride(0), H, Hkv, D // 2, BLOCK_H=BLOCK_H, BLOCK_HKV=BLOCK_HKV,
                             BLOCK_HALF=BLOCK_HALF, num_warps=min(max(BLOCK_H * BLOCK_HALF // 512, 1), 8))
