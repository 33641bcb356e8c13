"""The torch reference kernels against naive math and HF transformers' own functions."""

from __future__ import annotations

import pytest
import torch

import sgnb.kernels.attention as attention
from sgnb.kernels.attention import dense_causal_attention_ref, paged_attention_ref
from sgnb.kernels.norm import rms_norm_ref
from sgnb.kernels.rope import apply_rope_ref, rope_cos_sin, rope_inv_freq


@pytest.mark.parametrize(("H", "Hkv"), [(4, 4), (6, 2), (9, 3)])
def test_paged_attention_equals_dense(H, Hkv):
    """Ragged batch over scattered slots, some with a cached prefix, equals per-sequence dense attention."""
    g = torch.Generator().manual_seed(H * 10 + Hkv)
    D, S = 16, 200
    seqs = [(0, 7), (5, 1), (12, 9), (30, 1), (0, 1)]  # (prefix, extend)
    k_buf, v_buf = torch.randn(S, Hkv, D, generator=g), torch.randn(S, Hkv, D, generator=g)
    perm = torch.randperm(S - 1, generator=g) + 1
    req_to_token = torch.zeros(len(seqs), 64, dtype=torch.int64)
    used = 0
    for i, (p, e) in enumerate(seqs):
        req_to_token[i, : p + e] = perm[used: used + p + e]
        used += p + e
    q = torch.randn(sum(e for _, e in seqs), H, D, generator=g)
    out = paged_attention_ref(q, k_buf, v_buf, req_to_token, list(range(len(seqs))), [p for p, _ in seqs],
                              [e for _, e in seqs], D**-0.5)
    start = 0
    for i, (p, e) in enumerate(seqs):
        slots = req_to_token[i, : p + e]
        # dense attention over the whole sequence with dummy queries for the prefix, keep the last e rows
        full_q = torch.cat([torch.zeros(p, H, D), q[start: start + e]])
        ref = dense_causal_attention_ref(full_q, k_buf[slots], v_buf[slots], D**-0.5)[p:]
        torch.testing.assert_close(out[start: start + e], ref, atol=1e-5, rtol=1e-5)
        start += e


@pytest.mark.parametrize("decode", [True, False])
@pytest.mark.parametrize(("H", "Hkv"), [(4, 4), (9, 3)])
def test_cascade_attention_equals_plain(H, Hkv, decode, monkeypatch):
    """A batch sharing its first slots: the shared-prefix (cascade) path equals per-request attention."""
    g = torch.Generator().manual_seed(7 + H)
    D, S, shared = 16, 400, 37
    k_buf, v_buf = torch.randn(S, Hkv, D, generator=g), torch.randn(S, Hkv, D, generator=g)
    common = torch.randperm(S - 1, generator=g)[:shared] + 1
    free = [i for i in range(1, S) if i not in set(common.tolist())]
    seqs = [(shared + 3, 1), (shared, 1), (shared + 20, 1)] if decode else [(shared + 2, 5), (shared, 1), (shared + 9, 3)]
    req_to_token = torch.zeros(len(seqs), 128, dtype=torch.int64)
    used = 0
    for i, (p, e) in enumerate(seqs):
        own = p + e - shared
        req_to_token[i, :shared] = common
        req_to_token[i, shared: shared + own] = torch.tensor(free[used: used + own])
        used += own
    q = torch.randn(sum(e for _, e in seqs), H, D, generator=g)
    args = (q, k_buf, v_buf, req_to_token, list(range(len(seqs))), [p for p, _ in seqs], [e for _, e in seqs], D**-0.5)
    torch.testing.assert_close(paged_attention_ref(*args, shared_len=shared), paged_attention_ref(*args),
                               atol=1e-5, rtol=1e-5)
    if decode:  # the padded decode batch split into chunks of one request gives the same
        monkeypatch.setattr(attention, "DECODE_CHUNK_SLOTS", 1)
        torch.testing.assert_close(paged_attention_ref(*args, shared_len=shared), paged_attention_ref(*args),
                                   atol=1e-5, rtol=1e-5)


def test_rope_matches_transformers():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    D, T, H = 64, 11, 3
    inv = rope_inv_freq(D, 100000.0, None)
    cos, sin = rope_cos_sin(inv, 64)
    pos = torch.tensor([0, 1, 2, 5, 9, 17, 33, 40, 41, 62, 63])
    x = torch.randn(T, H, D)
    ours = apply_rope_ref(x, cos[pos], sin[pos])
    full_cos, full_sin = torch.cat([cos[pos], cos[pos]], -1), torch.cat([sin[pos], sin[pos]], -1)
    ref, _ = apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], full_cos[None], full_sin[None])
    torch.testing.assert_close(ours, ref[0].transpose(0, 1), atol=1e-6, rtol=1e-6)


def test_llama3_rope_scaling_matches_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    cfg = LlamaConfig(hidden_size=4096, num_attention_heads=32, rope_theta=500000.0, rope_scaling=scaling,
                      max_position_embeddings=131072)
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    ours = rope_inv_freq(128, 500000.0, scaling)
    torch.testing.assert_close(ours, ref.float(), atol=1e-7, rtol=1e-5)


def test_rms_norm_matches_transformers():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(48, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(48))
    x = torch.randn(5, 48) * 3
    torch.testing.assert_close(rms_norm_ref(x, norm.weight, 1e-5), norm(x), atol=1e-6, rtol=1e-6)
