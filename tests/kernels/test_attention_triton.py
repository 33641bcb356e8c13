"""The Triton attention kernels (split-K decode, ragged extend, merge_state) against their torch references,
sgnb.kernels.attention.paged_attention_ref and a dense float64 oracle, over scattered slots and ragged lengths.

Without a GPU they run in the Triton interpreter: fp32 (bf16 is broken there), small shapes and small tiles so
that short ranges still span several tiles. On CUDA: bf16, the production tiles and model-sized heads.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # must precede the kernels' import: triton reads it when decorating
    os.environ.setdefault("TRITON_INTERPRET", "1")

import importlib  # noqa: E402

import pytest  # noqa: E402

from sgnb.kernels.attention import paged_attention_ref  # noqa: E402

# the modules, not the same-named functions that sgnb.kernels re-exports
dec = importlib.import_module("sgnb.kernels.decode_attention")
ext = importlib.import_module("sgnb.kernels.extend_attention")
mrg = importlib.import_module("sgnb.kernels.merge_state")

CUDA = torch.cuda.is_available()
device = "cuda" if CUDA else "cpu"
dtype = torch.bfloat16 if CUDA else torch.float32
# Triton vs float64 / the float32 references: bf16 inputs, bf16 P in the PV product and a bf16 output on CUDA
TOL = {"atol": 3e-2, "rtol": 3e-2} if CUDA else {"atol": 2e-5, "rtol": 2e-5}
LSE_TOL = {"atol": 2e-2, "rtol": 1e-3} if CUDA else {"atol": 2e-5, "rtol": 2e-5}
# (H, Hkv, D): G = 1, 3, 4, 8 (on CUDA the shapes of Llama-2-7B, SmolLM2, Llama-3-8B)
HEADS = ([(32, 32, 128), (9, 3, 64), (32, 8, 128), (16, 2, 64)] if CUDA
         else [(4, 4, 16), (6, 2, 32), (8, 2, 16), (8, 1, 32)])

_modules = (dec, ext, mrg)
if not all(m.HAS_TRITON for m in _modules):
    _skip_reason = "triton is not installed"
elif not CUDA and not all(m.INTERPRETED for m in _modules):
    _skip_reason = ("no GPU, and sgnb.kernels' attention modules were imported before TRITON_INTERPRET=1 was set, "
                    "so their kernels were compiled for a GPU: run this file alone or set TRITON_INTERPRET=1")
else:
    _skip_reason = ""
needs_triton = pytest.mark.skipif(bool(_skip_reason), reason=_skip_reason)


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    """On CPU, 16-key tiles: the short ranges the interpreter can afford still span several tiles."""
    if not CUDA:
        monkeypatch.setattr(dec, "DECODE_BLOCK_N", 16)
        monkeypatch.setattr(ext, "EXTEND_BLOCK_N", 16)
        monkeypatch.setattr(ext, "EXTEND_BLOCK_M", 32)


# ---------------------------------------------------------------------------------------------------- helpers


def rand(*shape: int, g: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)


def make_pool(g: torch.Generator, lens: list[int], Hkv: int, D: int, shared: int = 0):
    """A KV pool with request i's lens[i] tokens at scattered slots of a shuffled row (the first `shared`
    positions of every row are the same slots). Slot 0 holds NaN: no kernel may read it unmasked; the rest of
    each row holds valid but wrong slots, so reading past a range changes the result.
    Returns k_buf, v_buf (S, Hkv, D), req_to_token (R, C) and rows (B,)."""
    B = len(lens)
    S = shared + sum(max(n - shared, 0) for n in lens) + 8
    k_buf, v_buf = rand(S, Hkv, D, g=g), rand(S, Hkv, D, g=g)
    k_buf[0], v_buf[0] = float("nan"), float("nan")
    perm = (torch.randperm(S - 1, generator=g) + 1).tolist()
    common, free = perm[:shared], perm[shared:]
    C = max(lens) + 24
    R = B + 3
    table = torch.randint(1, S, (R, C), generator=g)
    rows = torch.randperm(R, generator=g)[:B]
    used = 0
    for i, n in enumerate(lens):
        own = max(n - shared, 0)
        table[rows[i], :n] = torch.tensor(common[:n] + free[used: used + own], dtype=torch.int64)
        used += own
    return k_buf, v_buf, table.to(device), rows.to(device)


def dense_f64(q, k_buf, v_buf, slots, scale, visible):
    """Oracle: q (n, H, D) over the keys at `slots` (nk,), visible (n, nk) bool. Returns float64 out (n, H, D),
    zero for rows that see no key, and lse (n, H), natural log (-inf for such rows)."""
    H, Hkv = q.shape[1], k_buf.shape[1]
    k = k_buf[slots].double().repeat_interleave(H // Hkv, dim=1)  # (nk, H, D)
    v = v_buf[slots].double().repeat_interleave(H // Hkv, dim=1)  # (nk, H, D)
    s = torch.einsum("nhd,khd->hnk", q.double(), k) * scale  # (H, n, nk)
    s = s.masked_fill(~visible.to(s.device), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # (H, n)
    p = torch.exp(s - lse.clamp(min=-1e300).unsqueeze(-1))  # (H, n, nk)
    return torch.einsum("hnk,khd->nhd", p, v), lse.T


def poisoned(*shape: int, dt: torch.dtype) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dt, device=device)


def assert_written(t: torch.Tensor) -> None:
    assert not torch.isnan(t).any(), f"{int(torch.isnan(t).sum())} elements never written (or NaN)"


def decode_case(g: torch.Generator, H: int, Hkv: int, D: int):
    """Ragged decode batch over scattered slots: a length-1 request, lengths that end exactly on a tile edge."""
    bn = 16 if not CUDA else 64
    lens = [1, bn, 2 * bn + 3, 5, 4 * bn, 3 * bn - 1] if not CUDA else [1, 64, 1000, 129, 4096, 511, 2048, 37]
    k_buf, v_buf, table, rows = make_pool(g, lens, Hkv, D)
    return lens, k_buf, v_buf, table, rows, rand(len(lens), H, D, g=g)


def decode_oracle(q, k_buf, v_buf, table, rows, starts, ends, scale):
    outs, lses = [], []
    for i in range(q.shape[0]):
        slots = table[rows[i], starts[i]: max(ends[i], starts[i])]
        o, lse = dense_f64(q[i: i + 1], k_buf, v_buf, slots, scale, torch.ones(1, len(slots), dtype=torch.bool))
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


# ----------------------------------------------------------------------------------------------------- decode


def test_decode_ref_matches_dense_and_paged_ref():
    """The torch reference alone (runs without triton): float64 oracle and the engine's paged_attention_ref."""
    g = torch.Generator().manual_seed(1)
    H, Hkv, D = 6, 2, 16
    lens = [1, 9, 40, 3]
    k_buf, v_buf, table, rows = make_pool(g, lens, Hkv, D)
    k_buf[0], v_buf[0] = 0.0, 0.0  # paged_attention_ref's padding convention
    q = rand(len(lens), H, D, g=g)
    ends = torch.tensor(lens, device=device)
    lse = torch.empty(len(lens), H, device=device)
    out = dec.decode_attention_ref(q, k_buf, v_buf, table, rows, 0, ends, 0.3, lse=lse)
    ref_o, ref_lse = decode_oracle(q, k_buf, v_buf, table, rows, [0] * 4, lens, 0.3)
    torch.testing.assert_close(out.double(), ref_o, **TOL)
    torch.testing.assert_close(lse.double(), ref_lse, **LSE_TOL)
    paged = paged_attention_ref(q, k_buf, v_buf, table, rows.tolist(), [n - 1 for n in lens], [1] * 4, 0.3)
    torch.testing.assert_close(out, paged, **TOL)


@needs_triton
@pytest.mark.parametrize(("H", "Hkv", "D"), HEADS)
def test_decode_matches_refs(H, Hkv, D):
    """1 / several / more splits than tiles; kv_start 0, a python int and a per-request tensor."""
    g = torch.Generator().manual_seed(H * 100 + Hkv * 10 + D)
    lens, k_buf, v_buf, table, rows, q = decode_case(g, H, Hkv, D)
    B = len(lens)
    scale = D**-0.5
    ends = torch.tensor(lens, device=device, dtype=torch.int32)
    starts_t = torch.tensor([0, 3, 5, 2, 1, 3 * (16 if not CUDA else 64) - 1] + [7] * (B - 6), device=device)
    starts_t = torch.minimum(starts_t, ends.long())
    starts_t[1] = lens[1] - 1  # a length-1 range not at position 0
    starts_t[5] = lens[5]  # an empty range
    zeros, twos, per_request = (0, [0] * B), (2, [2] * B), (starts_t, starts_t.tolist())
    for num_splits, (kv_start, start_list) in [(1, zeros), (1, per_request), (3, per_request), (8, zeros),
                                               (8, twos)]:
        out, lse = poisoned(B, H, D, dt=dtype), poisoned(B, H, dt=torch.float32)
        res = dec.decode_attention(q, k_buf, v_buf, table, rows, kv_start, ends, scale, out=out, lse=lse,
                                   num_splits=num_splits)
        assert res is out
        assert_written(out)
        assert_written(lse)
        ref_lse = torch.empty(B, H, device=device)
        ref = dec.decode_attention_ref(q, k_buf, v_buf, table, rows, kv_start, ends, scale, lse=ref_lse)
        torch.testing.assert_close(out.float(), ref.float(), **TOL)
        torch.testing.assert_close(lse, ref_lse, **LSE_TOL)
        o64, lse64 = decode_oracle(q, k_buf, v_buf, table, rows, start_list, lens, scale)
        torch.testing.assert_close(out.double(), o64, **TOL)
        torch.testing.assert_close(lse.double(), lse64, **LSE_TOL)
        empty = torch.tensor([s >= e for s, e in zip(start_list, lens)], device=device)
        assert (out[empty] == 0).all() and torch.isneginf(lse[empty]).all()
        if not isinstance(kv_start, torch.Tensor) and kv_start == 0:  # the engine's reference for a decode step
            paged = paged_attention_ref(q, k_buf.nan_to_num(0.0), v_buf.nan_to_num(0.0), table, rows.tolist(),
                                        [n - 1 for n in lens], [1] * B, scale)
            torch.testing.assert_close(out.float(), paged.float(), **TOL)


def test_default_num_splits():
    assert dec.default_num_splits(1, 8) == 32 and dec.default_num_splits(256, 32) == 1
    assert all(dec.default_num_splits(b, h) in (1, 2, 4, 8, 16, 32) for b in (1, 3, 64, 1000) for h in (1, 8, 32))


@needs_triton
def test_decode_tiles_table_from_a_file(tmp_path, monkeypatch):
    """$SGNB_DECODE_TILES rows pick stage 1's tiles by batch size (first max_batch >= B), defaults past them."""
    path = tmp_path / "tiles.json"
    path.write_text('[{"max_batch": 64, "block_n": 32, "warps": 2, "stages": 2},'
                    ' {"max_batch": 8, "block_n": 128, "warps": 4, "stages": 1}]')
    monkeypatch.setenv("SGNB_DECODE_TILES", str(path))
    monkeypatch.setattr(dec, "DECODE_TILES", [])
    dec._load_tiles()
    assert dec.decode_tiles(1) == dec.decode_tiles(8) == (128, 4, 1)
    assert dec.decode_tiles(9) == dec.decode_tiles(64) == (32, 2, 2)
    assert dec.decode_tiles(65) == (dec.DECODE_BLOCK_N, dec.DECODE_WARPS, dec.DECODE_STAGES)


@needs_triton
@pytest.mark.parametrize("tiles", [(16, 2, 1), (32, 4, 2)])
def test_decode_with_explicit_tiles_matches_ref(tiles):
    g = torch.Generator().manual_seed(7)
    H, Hkv, D = HEADS[1]
    lens, k_buf, v_buf, table, rows, q = decode_case(g, H, Hkv, D)
    ends = torch.tensor(lens, device=device)
    for splits in (1, 4):
        out = dec.decode_attention(q, k_buf, v_buf, table, rows, 0, ends, D**-0.5, num_splits=splits, tiles=tiles)
        ref = dec.decode_attention_ref(q, k_buf, v_buf, table, rows, 0, ends, D**-0.5)
        torch.testing.assert_close(out.float(), ref.float(), **TOL)


def test_decode_without_lse_and_allocated_out():
    g = torch.Generator().manual_seed(5)
    H, Hkv, D = HEADS[2]
    lens, k_buf, v_buf, table, rows, q = decode_case(g, H, Hkv, D)
    ends = torch.tensor(lens, device=device)
    out = dec.decode_attention(q, k_buf, v_buf, table, rows, 0, ends, 0.1)
    assert out.shape == q.shape and out.dtype == q.dtype
    ref = dec.decode_attention_ref(q, k_buf, v_buf, table, rows, 0, ends, 0.1)
    torch.testing.assert_close(out.float(), ref.float(), **TOL)


@needs_triton
@pytest.mark.parametrize(("H", "Hkv", "D"), HEADS[1:3])
def test_decode_split_ranges_merge_to_whole(H, Hkv, D):
    """merge_state(decode over [0, s), decode over [s, L)) == decode over [0, L), lse included."""
    g = torch.Generator().manual_seed(11 + H)
    lens, k_buf, v_buf, table, rows, q = decode_case(g, H, Hkv, D)
    B = len(lens)
    ends = torch.tensor(lens, device=device)
    split = torch.tensor([(n * 2) // 5 for n in lens], device=device)  # 0 for the length-1 range: one side empty
    scale = D**-0.5
    lse1, lse2, lse = (poisoned(B, H, dt=torch.float32) for _ in range(3))
    o1 = dec.decode_attention(q, k_buf, v_buf, table, rows, 0, split, scale, lse=lse1, num_splits=3)
    o2 = dec.decode_attention(q, k_buf, v_buf, table, rows, split, ends, scale, lse=lse2, num_splits=2)
    whole = dec.decode_attention(q, k_buf, v_buf, table, rows, 0, ends, scale, lse=lse)
    merged_lse = poisoned(B, H, dt=torch.float32)
    merged = mrg.merge_state(o1, lse1, o2, lse2, out=o1, lse_out=merged_lse)
    assert merged is o1
    torch.testing.assert_close(merged.float(), whole.float(), **TOL)
    torch.testing.assert_close(merged_lse, lse, **LSE_TOL)


# ----------------------------------------------------------------------------------------------------- extend


def extend_case(g: torch.Generator, H: int, Hkv: int, D: int):
    """(prefix, extend) per request: no prefix, decode-like, longer than a query tile, ranges on tile edges."""
    # (14, 35) / (126, 500): prefix + m0 + 1 one short of a tile edge (16-key tiles and 32-query blocks on CPU,
    # 64 and 128 on CUDA), the last tile that all of a block's queries see in full; (17, 32) / (65, 300): a
    # block's last query sees exactly the first key of a new tile
    seqs = ([(0, 7), (5, 1), (12, 40), (30, 1), (0, 1), (16, 16), (14, 35), (17, 32)] if not CUDA
            else [(0, 300), (5, 1), (700, 129), (64, 64), (0, 1), (1000, 17), (128, 256), (126, 500), (65, 300),
                  (0, 1700)])  # a long fresh prompt: 27 query blocks, the diagonal walked 27 times
    lens = [p + e for p, e in seqs]
    k_buf, v_buf, table, rows = make_pool(g, lens, Hkv, D)
    T = sum(e for _, e in seqs)
    qo = torch.tensor([0] + [e for _, e in seqs], device=device).cumsum(0)
    return seqs, k_buf, v_buf, table, rows, rand(T, H, D, g=g), qo


def extend_oracle(q, k_buf, v_buf, table, rows, seqs, starts, causal, scale):
    outs, lses = [], []
    a = 0
    for i, (p, e) in enumerate(seqs):
        L = p + e
        key_pos = torch.arange(starts[i], L)  # (nk,)
        visible = torch.ones(e, len(key_pos), dtype=torch.bool)
        if causal:
            visible = key_pos[None, :] <= (L - e + torch.arange(e))[:, None]  # (e, nk) bottom-right aligned
        o, lse = dense_f64(q[a: a + e], k_buf, v_buf, table[rows[i], starts[i]: L], scale, visible)
        outs.append(o)
        lses.append(lse)
        a += e
    return torch.cat(outs), torch.cat(lses)


@needs_triton
@pytest.mark.parametrize(("H", "Hkv", "D"), HEADS)
def test_extend_causal_matches_refs(H, Hkv, D):
    g = torch.Generator().manual_seed(H * 7 + Hkv + D)
    seqs, k_buf, v_buf, table, rows, q, qo = extend_case(g, H, Hkv, D)
    T, B = q.shape[0], len(seqs)
    ends = torch.tensor([p + e for p, e in seqs], device=device)
    max_q = max(e for _, e in seqs)
    scale = D**-0.5
    out, lse = poisoned(T, H, D, dt=dtype), poisoned(T, H, dt=torch.float32)
    res = ext.extend_attention(q, k_buf, v_buf, table, rows, qo, 0, ends, True, scale, max_q, out=out, lse=lse)
    assert res is out
    assert_written(out)
    assert_written(lse)
    o64, lse64 = extend_oracle(q, k_buf, v_buf, table, rows, seqs, [0] * B, True, scale)
    torch.testing.assert_close(out.double(), o64, **TOL)
    torch.testing.assert_close(lse.double(), lse64, **LSE_TOL)
    ref_lse = torch.empty(T, H, device=device)
    ref = ext.extend_attention_ref(q, k_buf, v_buf, table, rows, qo, 0, ends, True, scale, max_q, lse=ref_lse)
    torch.testing.assert_close(out.float(), ref.float(), **TOL)
    torch.testing.assert_close(lse, ref_lse, **LSE_TOL)
    paged = paged_attention_ref(q, k_buf.nan_to_num(0.0), v_buf.nan_to_num(0.0), table, rows.tolist(),
                                [p for p, _ in seqs], [e for _, e in seqs], scale)
    torch.testing.assert_close(out.float(), paged.float(), **TOL)


@needs_triton
@pytest.mark.parametrize(("H", "Hkv", "D"), HEADS[:2])
def test_extend_reversed_blocks_and_long_tiles_match_the_oracle(H, Hkv, D, monkeypatch):
    """EXTEND_REVERSE (causal query blocks launched last-first) and EXTEND_LONG_TILES (own tiles for long query
    runs) change the launch, not the result: every row written, equal to the float64 oracle, causal and not."""
    g = torch.Generator().manual_seed(5 * H + D)
    seqs, k_buf, v_buf, table, rows, q, qo = extend_case(g, H, Hkv, D)
    T, B = q.shape[0], len(seqs)
    ends = torch.tensor([p + e for p, e in seqs], device=device)
    max_q = max(e for _, e in seqs)
    scale = D**-0.5
    alt = 32 if ext.extend_block_m(D, max_q) != 32 else 16  # a BLOCK_M that differs from the default's
    long_tiles = (alt, 32, 4, 2 if CUDA else 1)
    monkeypatch.setattr(ext, "EXTEND_REVERSE", True)
    monkeypatch.setattr(ext, "EXTEND_LONG_MIN", 1)
    monkeypatch.setattr(ext, "EXTEND_LONG_TILES", long_tiles)
    assert ext._extend_config(D, max_q, long=True)[0] == long_tiles[0]
    assert ext.extend_block_m(D, max_q) != long_tiles[0]  # a block table is built with the default tiles
    for causal in (True, False):
        out, lse = poisoned(T, H, D, dt=dtype), poisoned(T, H, dt=torch.float32)
        ext.extend_attention(q, k_buf, v_buf, table, rows, qo, 0, ends, causal, scale, max_q, out=out, lse=lse)
        assert_written(out)
        assert_written(lse)
        o64, lse64 = extend_oracle(q, k_buf, v_buf, table, rows, seqs, [0] * B, causal, scale)
        torch.testing.assert_close(out.double(), o64, **TOL)
        torch.testing.assert_close(lse.double(), lse64, **LSE_TOL)


@needs_triton
@pytest.mark.parametrize(("H", "Hkv", "D"), HEADS[:2])
def test_extend_block_table_equals_the_grid(H, Hkv, D):
    """The block-table launch (what extend CUDA graphs use: a fixed grid, unused rows of the table idle) writes
    the same rows as the per-request grid, leaves rows past the batch untouched, and an all-idle table writes
    nothing."""
    import numpy as np

    g = torch.Generator().manual_seed(H + D)
    seqs, k_buf, v_buf, table, rows, q, qo = extend_case(g, H, Hkv, D)
    T = q.shape[0]
    ends = torch.tensor([p + e for p, e in seqs], device=device)
    max_q = max(e for _, e in seqs)
    scale = D**-0.5
    want = ext.extend_attention(q, k_buf, v_buf, table, rows, qo, 0, ends, True, scale, max_q)
    pad = 5  # rows of q beyond the batch (a graph's padding tokens): never written
    qp = torch.cat([q, rand(pad, H, D, g=g)])
    bm = ext.extend_block_m(D, max_q)
    lens = np.array([e for _, e in seqs])
    blocks = ext.extend_blocks(lens, bm, capacity=int((-(-lens // bm)).sum()) + 7)
    assert (blocks[-7:, 0] == -1).all() and blocks[0].tolist() == [0, 0]
    out = poisoned(T + pad, H, D, dt=dtype)
    ext.extend_attention(qp, k_buf, v_buf, table, rows, qo, 0, ends, True, scale, max_q, out=out,
                         blocks=torch.from_numpy(blocks).to(device))
    torch.testing.assert_close(out[:T], want)
    assert torch.isnan(out[T:]).all()
    idle = poisoned(T + pad, H, D, dt=dtype)
    ext.extend_attention(qp, k_buf, v_buf, table, rows, qo, 0, ends, True, scale, max_q, out=idle,
                         blocks=torch.from_numpy(np.full((4, 2), (-1, 0))).to(device))
    assert torch.isnan(idle).all()


@needs_triton
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(("H", "Hkv", "D"), HEADS[1:3])
def test_extend_kv_start(H, Hkv, D, causal):
    """kv_start > 0 (a tensor, and a python int): causal rows before the range's first key see nothing."""
    g = torch.Generator().manual_seed(3 * H + causal)
    seqs, k_buf, v_buf, table, rows, q, qo = extend_case(g, H, Hkv, D)
    T, B = q.shape[0], len(seqs)
    lens = [p + e for p, e in seqs]
    ends = torch.tensor(lens, device=device)
    max_q = max(e for _, e in seqs)
    scale = D**-0.5
    # request 2: its range starts inside its own new tokens, so its first queries see no key when causal
    starts = [min(p + 1, L - 1) if i != 2 else p + e // 2 for i, ((p, e), L) in enumerate(zip(seqs, lens))]
    for kv_start, start_list in ((torch.tensor(starts, device=device), starts), (1, [1] * B)):
        out, lse = poisoned(T, H, D, dt=dtype), poisoned(T, H, dt=torch.float32)
        ext.extend_attention(q, k_buf, v_buf, table, rows, qo, kv_start, ends, causal, scale, max_q, out=out,
                             lse=lse)
        assert_written(out)
        assert_written(lse)
        o64, lse64 = extend_oracle(q, k_buf, v_buf, table, rows, seqs, start_list, causal, scale)
        torch.testing.assert_close(out.double(), o64, **TOL)
        torch.testing.assert_close(lse.double(), lse64, **LSE_TOL)
        if causal and isinstance(kv_start, torch.Tensor):
            a, e = int(qo[2]), seqs[2][1]
            assert torch.isneginf(lse[a: a + e // 2]).all() and (out[a: a + e // 2] == 0).all()


@needs_triton
@pytest.mark.parametrize("decode", [True, False])
@pytest.mark.parametrize(("H", "Hkv", "D"), HEADS[:3])
def test_shared_prefix_cascade(H, Hkv, D, decode):
    """The cascade use: every query of the batch over one row's first `shared` slots (causal=False), each
    request over its own keys from `shared` on, merged by lse == plain attention over each whole request."""
    g = torch.Generator().manual_seed(17 * H + decode)
    shared = 37 if not CUDA else 1000
    seqs = ([(shared + 3, 1), (shared, 1), (shared + 20, 1)] if decode
            else [(shared + 2, 5), (shared, 1), (shared + 9, 20)])
    lens = [p + e for p, e in seqs]
    k_buf, v_buf, table, rows = make_pool(g, lens, Hkv, D, shared=shared)
    T, B = sum(e for _, e in seqs), len(seqs)
    q = rand(T, H, D, g=g)
    qo = torch.tensor([0] + [e for _, e in seqs], device=device).cumsum(0)
    ends = torch.tensor(lens, device=device)
    scale = D**-0.5
    lse1, lse2 = poisoned(T, H, dt=torch.float32), poisoned(T, H, dt=torch.float32)
    o1 = ext.extend_attention(q, k_buf, v_buf, table, rows[:1], qo[[0, B]], 0,
                              torch.tensor([shared], device=device), False, scale, T, lse=lse1)
    if decode:
        o2 = dec.decode_attention(q, k_buf, v_buf, table, rows, shared, ends, scale, lse=lse2, num_splits=4)
    else:
        o2 = ext.extend_attention(q, k_buf, v_buf, table, rows, qo, shared, ends, True, scale,
                                  max(e for _, e in seqs), lse=lse2)
    assert_written(lse1)
    assert_written(lse2)
    out = mrg.merge_state(o1, lse1, o2, lse2, out=o1)
    assert_written(out)
    o64, _ = extend_oracle(q, k_buf, v_buf, table, rows, seqs, [0] * B, True, scale)
    torch.testing.assert_close(out.double(), o64, **TOL)
    paged = paged_attention_ref(q, k_buf.nan_to_num(0.0), v_buf.nan_to_num(0.0), table, rows.tolist(),
                                [p for p, _ in seqs], [e for _, e in seqs], scale)
    torch.testing.assert_close(out.float(), paged.float(), **TOL)


# ------------------------------------------------------------------------------------------------ merge_state


@needs_triton
@pytest.mark.parametrize(("H", "D"), [(9, 64), (32, 128)] if CUDA else [(3, 16), (20, 32)])
def test_merge_state_matches_ref(H, D):
    """Random partials, with rows where one side (its o NaN) or both sides saw no key; in place over o1."""
    g = torch.Generator().manual_seed(H + D)
    N = 7
    o1, o2 = rand(N, H, D, g=g), rand(N, H, D, g=g)
    lse1 = (torch.randn(N, H, generator=g) * 4).to(device)
    lse2 = (torch.randn(N, H, generator=g) * 4).to(device)
    lse1[1], o1[1] = float("-inf"), float("nan")
    lse2[2], o2[2] = float("-inf"), float("nan")
    lse1[3, :2], lse2[3, :2] = float("-inf"), float("-inf")
    o1[3, :2], o2[3, :2] = float("nan"), float("nan")
    ref_lse = torch.empty(N, H, device=device)
    ref = mrg.merge_state_ref(o1, lse1, o2, lse2, lse_out=ref_lse)
    lse = poisoned(N, H, dt=torch.float32)
    out = mrg.merge_state(o1.clone(), lse1, o2, lse2, lse_out=lse)
    in_place = o1.clone()
    mrg.merge_state(in_place, lse1, o2, lse2, out=in_place)
    for got in (out, in_place):
        assert_written(got)
        torch.testing.assert_close(got.float(), ref.float(), **TOL)
    torch.testing.assert_close(lse, ref_lse, **LSE_TOL)
    # the reference against the definition, in float64
    w1 = torch.exp(lse1.double() - torch.logaddexp(lse1.double(), lse2.double()))[..., None].nan_to_num(0.0)
    w2 = torch.exp(lse2.double() - torch.logaddexp(lse1.double(), lse2.double()))[..., None].nan_to_num(0.0)
    want = torch.where(w1 > 0, w1 * o1.double(), 0.0) + torch.where(w2 > 0, w2 * o2.double(), 0.0)
    torch.testing.assert_close(ref.double(), want, **TOL)
    torch.testing.assert_close(ref_lse.double(), torch.logaddexp(lse1.double(), lse2.double()), **LSE_TOL)
    assert (ref[3, :2] == 0).all() and torch.isneginf(ref_lse[3, :2]).all()


# --------------------------------------------------------------------------------------------- CUDA graphs


@needs_triton
@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_kernels_capture_in_a_cuda_graph():
    """The launch path does no host syncs: decode + extend + merge capture in a graph, and replays follow new
    lengths written into the captured tensors."""
    g = torch.Generator().manual_seed(23)
    H, Hkv, D = 32, 8, 128
    lens, k_buf, v_buf, table, rows, q = decode_case(g, H, Hkv, D)
    B = len(lens)
    ends = torch.tensor(lens, device=device)
    qo = torch.arange(B + 1, device=device)
    out = torch.empty_like(q)
    lse1, lse2 = torch.empty(B, H, device=device), torch.empty(B, H, device=device)
    starts = torch.zeros(B, dtype=torch.int64, device=device)

    def step():
        o1 = dec.decode_attention(q, k_buf, v_buf, table, rows, 0, starts + 1, D**-0.5, lse=lse1)
        ext.extend_attention(q, k_buf, v_buf, table, rows, qo, starts + 1, ends, True, D**-0.5, 1, out=out,
                             lse=lse2)
        mrg.merge_state(o1, lse1, out, lse2, out=out)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for new_lens in (lens, [max(n // 3, 1) for n in lens]):
        ends.copy_(torch.tensor(new_lens))
        graph.replay()
        torch.cuda.synchronize()
        o64, _ = decode_oracle(q, k_buf, v_buf, table, rows, [0] * B, new_lens, D**-0.5)
        torch.testing.assert_close(out.double(), o64, **TOL)


# ---------------------------------------------------------------------------------------------- sliding window


@needs_triton
@pytest.mark.parametrize("window", [1, 5, 16, 37])
@pytest.mark.parametrize(("H", "Hkv", "D"), HEADS[:2])
def test_extend_sliding_window(H, Hkv, D, window):
    """A window W: query j of a request sees only its last W positions. The grid launch, the block-table
    launch and the reference all equal the float64 oracle; windows narrower and wider than a key tile, and
    blocks whose rows start their windows in different tiles."""
    import numpy as np

    g = torch.Generator().manual_seed(11 * H + D + window)
    seqs, k_buf, v_buf, table, rows, q, qo = extend_case(g, H, Hkv, D)
    T = q.shape[0]
    ends = torch.tensor([p + e for p, e in seqs], device=device)
    max_q = max(e for _, e in seqs)
    scale = D**-0.5
    outs, lses, a = [], [], 0
    for i, (p, e) in enumerate(seqs):
        L = p + e
        key_pos = torch.arange(L)  # (L,)
        q_pos = (L - e + torch.arange(e))[:, None]  # (e, 1)
        visible = (key_pos[None, :] <= q_pos) & (key_pos[None, :] > q_pos - window)  # (e, L)
        o, lse = dense_f64(q[a: a + e], k_buf, v_buf, table[rows[i], :L], scale, visible)
        outs.append(o)
        lses.append(lse)
        a += e
    o64, lse64 = torch.cat(outs), torch.cat(lses)
    out, lse = poisoned(T, H, D, dt=dtype), poisoned(T, H, dt=torch.float32)
    ext.extend_attention(q, k_buf, v_buf, table, rows, qo, 0, ends, True, scale, max_q, out=out, lse=lse,
                         window=window)
    assert_written(out)
    torch.testing.assert_close(out.double(), o64, **TOL)
    torch.testing.assert_close(lse.double(), lse64, **LSE_TOL)
    ref = ext.extend_attention_ref(q, k_buf, v_buf, table, rows, qo, 0, ends, True, scale, max_q, window=window)
    torch.testing.assert_close(ref.double(), o64, **TOL)
    bm = ext.extend_block_m(D, max_q)
    lens = np.array([e for _, e in seqs])
    blocks = ext.extend_blocks(lens, bm, capacity=int((-(-lens // bm)).sum()) + 3)
    got = poisoned(T, H, D, dt=dtype)
    ext.extend_attention(q, k_buf, v_buf, table, rows, qo, 0, ends, True, scale, max_q, out=got,
                         blocks=torch.from_numpy(blocks).to(device), window=window)
    torch.testing.assert_close(got.double(), o64, **TOL)
    # the same tiles give the same result; on a GPU the plain launch of a long prompt takes the long-prompt tiles
    # (EXTEND_LONG_TILES) and sums in another order: a few elements then differ in their last bf16 bit
    torch.testing.assert_close(got, out, **({"atol": 8e-3, "rtol": 1.6e-2} if CUDA else {}))


@needs_triton
@pytest.mark.parametrize(("H", "Hkv", "D"), HEADS[:2])
def test_decode_sliding_window_start(H, Hkv, D):
    """Decode over a window is decode from a per-request start max(0, len - W): what the backends pass."""
    g = torch.Generator().manual_seed(3 * H + D)
    lens, k_buf, v_buf, table, rows, q = decode_case(g, H, Hkv, D)
    ends = torch.tensor(lens, device=device)
    window = 7
    starts = (ends - window).clamp(min=0)
    out = dec.decode_attention(q, k_buf, v_buf, table, rows, starts, ends, D**-0.5, num_splits=2)
    o64, _ = decode_oracle(q, k_buf, v_buf, table, rows, starts.tolist(), lens, D**-0.5)
    torch.testing.assert_close(out.double(), o64, **TOL)
