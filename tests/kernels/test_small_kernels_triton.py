"""The small Triton kernels (norm, rope, activation, KV store, bitmask) against their torch references and HF.

On a machine without a GPU they run in the Triton interpreter (fp32: bf16 is broken there); on CUDA in bf16.
The tests call each module's Triton wrapper (`_*_triton`) directly, so they test the kernels whatever the
dispatch rule; test_dispatch checks which path each public function takes.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # must precede the kernels' import: triton reads it when decorating
    os.environ.setdefault("TRITON_INTERPRET", "1")

import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402

from sgnb.kernels import _triton_utils, activation, bitmask, kv_store, norm, rope  # noqa: E402
from sgnb.kernels.activation import _silu_and_mul_triton, silu_and_mul_ref  # noqa: E402
from sgnb.kernels.bitmask import _apply_token_bitmask_triton, apply_token_bitmask_ref  # noqa: E402
from sgnb.kernels.kv_store import _store_kv_triton, store_kv_ref  # noqa: E402
from sgnb.kernels.norm import _rms_norm_triton, fused_add_rms_norm_ref, rms_norm_ref  # noqa: E402
from sgnb.kernels.rope import _apply_rope_triton, apply_rope_inplace_ref, rope_cos_sin, rope_inv_freq  # noqa: E402

CUDA = torch.cuda.is_available()
if not _triton_utils.HAS_TRITON:
    pytest.skip("triton is not installed", allow_module_level=True)
if not CUDA and not _triton_utils.INTERPRET:
    pytest.skip("no GPU, and sgnb.kernels was imported before TRITON_INTERPRET=1 was set: the kernels were "
                "compiled for a GPU; run this file alone or set TRITON_INTERPRET=1", allow_module_level=True)

device = "cuda" if CUDA else "cpu"
dtype = torch.bfloat16 if CUDA else torch.float32
TOL = {"atol": 1e-2, "rtol": 1.6e-2} if CUDA else {"atol": 1e-5, "rtol": 1e-5}


def rand(*shape: int, g: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)


@pytest.fixture
def nan_empty(monkeypatch):
    """torch.empty hands out NaN-filled floats, so an output element the kernel forgets to write shows up."""
    real = torch.empty

    def poisoned(*args, **kwargs):
        t = real(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", poisoned)


# ---------------------------------------------------------------- RMSNorm

@pytest.mark.parametrize(("T", "N", "strided"), [(1, 576, False), (5, 1536, True), (3, 100, False),
                                               (33, 4096, True)])
def test_rms_norm(T, N, strided, nan_empty):
    g = torch.Generator().manual_seed(T * N)
    wide = rand(T, N + 24, g=g, scale=3.0)
    x = wide[:, 8: 8 + N] if strided else wide[:, :N].contiguous()  # (T, N), row stride N + 24 when strided
    w = rand(N, g=g)
    before = wide.clone()
    y = _rms_norm_triton(x, w, 1e-5)
    assert y.shape == x.shape and y.dtype == dtype and not y.isnan().any()
    torch.testing.assert_close(y, rms_norm_ref(x, w, 1e-5), **TOL)
    assert torch.equal(wide, before)  # the input is not touched


def test_rms_norm_leading_dims():
    g = torch.Generator().manual_seed(1)
    x, w = rand(2, 3, 64, g=g), rand(64, g=g)  # (B, T, N)
    torch.testing.assert_close(_rms_norm_triton(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), **TOL)


def test_rms_norm_rounds_like_hf():
    """In a 16-bit dtype the normalized x is rounded before the weight multiply (HF's order): nearly every
    element is bit-equal to the reference, which a single final rounding would not give."""
    g = torch.Generator().manual_seed(3)
    half = torch.bfloat16 if CUDA else torch.float16  # the interpreter handles fp16, not bf16
    x = (torch.randn(8, 1536, generator=g) * 3).to(device=device, dtype=half)
    w = (torch.randn(1536, generator=g)).to(device=device, dtype=half)
    y = _rms_norm_triton(x, w, 1e-5)
    assert y.dtype == half
    assert (y == rms_norm_ref(x, w, 1e-5)).float().mean() > 0.99


@pytest.mark.parametrize(("T", "N", "mixed"), [(1, 576, False), (6, 1536, False), (4, 96, False), (3, 576, True)])
def test_fused_add_rms_norm(T, N, mixed, nan_empty):
    """mixed: x in a narrower dtype than the residual stream (fp16 into fp32 here, bf16 into fp32 on CUDA)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(T + N)
    wide = rand(T, 2 * N, g=g, scale=2.0)
    x = wide[:, N:]  # (T, N), a strided view
    residual, w = rand(T, N, g=g, scale=4.0), rand(N, g=g)
    if mixed:
        x, residual, w = x.to(torch.bfloat16 if CUDA else torch.float16), residual.float(), w.float()
    r0 = residual.clone()
    y = _rms_norm_triton(x, w, 1e-5, residual)
    assert not y.isnan().any()
    ref_y, ref_r = fused_add_rms_norm_ref(x.clone(), r0.clone(), w, 1e-5)
    torch.testing.assert_close(residual, ref_r, **TOL)
    torch.testing.assert_close(y, ref_y, **TOL)
    norm = LlamaRMSNorm(N, eps=1e-5).to(device=device, dtype=w.dtype)
    with torch.no_grad():
        norm.weight.copy_(w)
        torch.testing.assert_close(y, norm(r0 + x), **TOL)


# ---------------------------------------------------------------- RoPE

@pytest.mark.parametrize(("H", "Hkv", "D"), [(9, 3, 64), (4, 1, 128), (2, 2, 32), (32, 8, 128)])
def test_apply_rope_on_fused_qkv_views(H, Hkv, D):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(H * D + Hkv)
    T, P = 7, 300
    cos, sin = (t.to(device) for t in rope_cos_sin(rope_inv_freq(D, 10000.0, None), P))
    positions = torch.tensor([0, 299, 5, 5, 17, 128, 1], device=device)  # unsorted, repeated
    qkv = rand(T, (H + 2 * Hkv) * D, g=g)  # the fused projection's output
    q = qkv[:, : H * D].view(T, H, D)  # (T, H, D), row stride (H + 2 Hkv) D
    k = qkv[:, H * D: (H + Hkv) * D].view(T, Hkv, D)  # (T, Hkv, D)
    ref = qkv.clone()
    ref_q, ref_k = ref[:, : H * D].view(T, H, D), ref[:, H * D: (H + Hkv) * D].view(T, Hkv, D)
    q32, k32 = q.float().clone(), k.float().clone()  # HF's math on the same inputs, in fp32
    out_q, out_k = _apply_rope_triton(q, k, positions, cos, sin)
    assert out_q is q and out_k is k
    apply_rope_inplace_ref(ref_q, ref_k, positions, cos, sin)
    torch.testing.assert_close(qkv, ref, **TOL)  # q and k as the reference; v untouched
    assert torch.equal(qkv[:, (H + Hkv) * D:], ref[:, (H + Hkv) * D:])
    full_cos = torch.cat([cos[positions], cos[positions]], -1)  # (T, D)
    full_sin = torch.cat([sin[positions], sin[positions]], -1)  # (T, D)
    hf_q, hf_k = apply_rotary_pos_emb(q32, k32, full_cos, full_sin, unsqueeze_dim=1)
    torch.testing.assert_close(q, hf_q.to(dtype), **TOL)
    torch.testing.assert_close(k, hf_k.to(dtype), **TOL)


@pytest.mark.parametrize(("H", "Hkv", "D", "buf_dtype"), [(9, 3, 64, None), (4, 1, 128, None), (32, 32, 128, None),
                                                       (4, 2, 32, torch.float16)])
def test_apply_rope_and_store_equals_rope_then_store(H, Hkv, D, buf_dtype):
    """The fused launch rotates q and k in place as apply_rope does and writes the rotated k and v at their
    slots as store_kv does (cast to the pool's dtype); every other slot and v stay untouched."""
    g = torch.Generator().manual_seed(H * D + Hkv + 1)
    T, P, S = 7, 300, 20
    cos, sin = (t.to(device) for t in rope_cos_sin(rope_inv_freq(D, 10000.0, None), P))
    positions = torch.tensor([0, 299, 5, 5, 17, 128, 1], device=device)
    loc = torch.tensor([3, 19, 7, 1, 12, 4, 15], device=device)  # distinct, unsorted
    qkv = rand(T, (H + 2 * Hkv) * D, g=g)
    q, k, v = (qkv[:, a * D: b * D].view(T, -1, D) for a, b in ((0, H), (H, H + Hkv), (H + Hkv, H + 2 * Hkv)))
    k_buf = rand(S, Hkv, D, g=g).to(buf_dtype or dtype)
    v_buf = rand(S, Hkv, D, g=g).to(buf_dtype or dtype)
    ref_qkv, ref_kb, ref_vb = qkv.clone(), k_buf.clone(), v_buf.clone()
    rq, rk, rv = (ref_qkv[:, a * D: b * D].view(T, -1, D) for a, b in ((0, H), (H, H + Hkv), (H + Hkv, H + 2 * Hkv)))
    apply_rope_inplace_ref(rq, rk, positions, cos, sin)
    store_kv_ref(ref_kb, ref_vb, loc, rk, rv)
    rope.apply_rope_and_store(q, k, v, positions, cos, sin, k_buf, v_buf, loc)
    torch.testing.assert_close(qkv, ref_qkv, **TOL)
    assert torch.equal(qkv[:, (H + Hkv) * D:], ref_qkv[:, (H + Hkv) * D:])  # v itself untouched
    torch.testing.assert_close(k_buf, ref_kb, **TOL)
    assert torch.equal(v_buf, ref_vb)  # a copy: exact
    untouched = torch.ones(S, dtype=torch.bool)
    untouched[loc.cpu()] = False
    assert torch.equal(k_buf[untouched.to(device)], ref_kb[untouched.to(device)])


# ---------------------------------------------------------------- SiLU and mul

@pytest.mark.parametrize(("T", "inter", "strided"), [(1, 1536, False), (4, 576, True), (2, 2500, False),
                                               (3, 11008, True)])
def test_silu_and_mul(T, inter, strided, nan_empty):
    g = torch.Generator().manual_seed(T * inter)
    wide = rand(T, 2 * inter + 16, g=g, scale=3.0)
    x = wide[:, 16:] if strided else wide[:, : 2 * inter].contiguous()  # (T, 2I)
    y = _silu_and_mul_triton(x)
    assert y.shape == (T, inter) and y.dtype == dtype and not y.isnan().any()
    torch.testing.assert_close(y, silu_and_mul_ref(x), **TOL)
    gate, up = x[:, :inter].float(), x[:, inter:].float()
    torch.testing.assert_close(y, (torch.nn.functional.silu(gate) * up).to(dtype), **TOL)


# ---------------------------------------------------------------- KV store

@pytest.mark.parametrize(("Hkv", "D", "buf_dtype", "loc_dtype"), [
    (3, 64, None, torch.int64), (1, 128, torch.float16, torch.int32), (8, 32, None, torch.int32)])
def test_store_kv_from_fused_qkv(Hkv, D, buf_dtype, loc_dtype):
    g = torch.Generator().manual_seed(Hkv * D)
    T, H, S = 6, 2 * Hkv, 40
    buf_dtype = buf_dtype or dtype
    qkv = rand(T, (H + 2 * Hkv) * D, g=g)
    k = qkv[:, H * D: (H + Hkv) * D].view(T, Hkv, D)  # (T, Hkv, D), strided
    v = qkv[:, (H + Hkv) * D:].view(T, Hkv, D)  # (T, Hkv, D), strided
    k_buf = torch.full((S, Hkv, D), float("nan"), dtype=buf_dtype, device=device)
    v_buf = torch.full((S, Hkv, D), float("nan"), dtype=buf_dtype, device=device)
    loc = torch.randperm(S, generator=g)[:T].to(device=device, dtype=loc_dtype)
    _store_kv_triton(k_buf, v_buf, loc, k, v)
    ref_k, ref_v = torch.zeros_like(k_buf), torch.zeros_like(v_buf)
    store_kv_ref(ref_k, ref_v, loc.long(), k, v)
    assert torch.equal(k_buf[loc.long()], ref_k[loc.long()]) and torch.equal(v_buf[loc.long()], ref_v[loc.long()])
    untouched = torch.ones(S, dtype=torch.bool, device=device)
    untouched[loc.long()] = False
    assert k_buf[untouched].isnan().all() and v_buf[untouched].isnan().all()


# ---------------------------------------------------------------- token bitmask

def _grammar_oracle():
    """engine/grammar.py's apply_bitmask_torch, the contract's owner; None where xgrammar is missing (GPU box)."""
    try:
        from sgnb.engine.grammar import apply_bitmask_torch
    except ImportError:
        return None
    return apply_bitmask_torch


@pytest.mark.parametrize(("V", "W"), [(49152, 1536), (50257, 1571), (128256, 4008), (1000, 20), (17, 1),
                                     (100, 40)])
@pytest.mark.parametrize("rows", [None, [2, 0], "tensor"])
def test_apply_token_bitmask(V, W, rows):
    """W*32 >= V (49152, 50257 rounded up), W*32 < V (1000 with 20 words: past 640 banned) and W*32 >> V."""
    apply_bitmask_torch = _grammar_oracle()
    g = torch.Generator().manual_seed(V + W)
    B, Bm = 3, 4  # the bitmask may have more rows than the logits
    bitmask = torch.randint(-(2**31), 2**31, (Bm, W), generator=g, dtype=torch.int64).to(torch.int32)
    bitmask[1] = 0  # row 1 bans everything; row 2 allows a sparse set, like a grammar would
    bitmask[2] &= torch.randint(0, 2**31, (W,), generator=g, dtype=torch.int64).to(torch.int32) & 0x01010101
    bitmask = bitmask.to(device)
    logits = rand(B, V, g=g)
    ours, oracle, ref = logits.clone(), logits.clone(), logits.clone()  # Triton, engine, kernels' ref
    row_list = None if rows is None else [2, 0]
    rows_arg = torch.tensor([2, 0], device=device) if rows == "tensor" else row_list
    _apply_token_bitmask_triton(ours, bitmask, rows_arg)
    apply_token_bitmask_ref(ref, bitmask, rows_arg)
    if apply_bitmask_torch is not None:
        apply_bitmask_torch(oracle, bitmask, row_list)
        assert torch.equal(ref, oracle)
    assert torch.equal(ours, ref)
    if rows is not None:
        assert torch.equal(ours[1], logits[1])  # a row not listed is untouched
    if W * 32 < V:
        assert ours[0, W * 32:].eq(float("-inf")).all()


def test_apply_token_bitmask_no_rows_is_noop():
    g = torch.Generator().manual_seed(0)
    logits = rand(2, 64, g=g)
    before = logits.clone()
    _apply_token_bitmask_triton(logits, torch.zeros(2, 2, dtype=torch.int32, device=device), [])
    _apply_token_bitmask_triton(logits, torch.zeros(2, 2, dtype=torch.int32, device=device),
                                torch.zeros(0, dtype=torch.int64, device=device))
    assert torch.equal(logits, before)


# ---------------------------------------------------------------- dispatch

def _dispatch_cases():
    """(module, public name, Triton wrapper, reference, args factory) for every dispatcher."""
    def norm_args():
        return torch.randn(3, 8), torch.randn(8), 1e-5

    def fused_args():
        return torch.randn(3, 8), torch.randn(3, 8), torch.randn(8), 1e-5

    def rope_args():
        cos, sin = rope_cos_sin(rope_inv_freq(8, 10000.0, None), 4)
        return torch.randn(2, 2, 8), torch.randn(2, 1, 8), torch.tensor([0, 3]), cos, sin

    def kv_args():
        return torch.zeros(4, 1, 8), torch.zeros(4, 1, 8), torch.tensor([1, 3]), torch.randn(2, 1, 8), torch.randn(2, 1, 8)

    def mask_args():
        return torch.randn(2, 40), torch.ones(2, 2, dtype=torch.int32)

    # (module, public, Triton wrapper, CPU reference, args, our C kernel that float32 CPU tensors take instead
    # where it is built: kernels/native.py)
    return [(norm, "rms_norm", "_rms_norm_triton", "rms_norm_ref", norm_args, "rms_norm"),
            (norm, "fused_add_rms_norm", "_rms_norm_triton", "fused_add_rms_norm_ref", fused_args, "rms_norm"),
            (rope, "apply_rope", "_apply_rope_triton", "_apply_rope_cpu", rope_args, "rope"),
            (activation, "silu_and_mul", "_silu_and_mul_triton", "silu_and_mul_ref", lambda: (torch.randn(2, 8),),
             "silu_mul"),
            (kv_store, "store_kv", "_store_kv_triton", "store_kv_ref", kv_args, None),
            (bitmask, "apply_token_bitmask", "_apply_token_bitmask_triton", "apply_token_bitmask_ref", mask_args,
             None)]


@pytest.mark.parametrize("interpret", [False, True])
@pytest.mark.parametrize("case", _dispatch_cases(), ids=lambda c: c[1])
def test_dispatch(case, interpret, monkeypatch):
    """CPU tensors take the torch reference (rope in float32: its CPU path, tested against the reference
    below), or our C kernel for float32 where it is built (tested against the references in test_native.py),
    with or without the interpreter (it is for tests, which call the Triton wrappers directly); CUDA tensors
    take the Triton wrapper."""
    from sgnb.kernels import native

    module, public, wrapper, ref, make_args, ours = case

    class Routed(Exception):
        pass

    def to_triton(*args, **kwargs):
        raise Routed

    real_ref = getattr(module, ref)
    calls: list[str] = []
    monkeypatch.setattr(module, wrapper, to_triton)
    monkeypatch.setattr(module, ref, lambda *a, **k: (calls.append(ref), real_ref(*a, **k))[1])
    if ours is not None:
        real_ours = getattr(native, ours)
        monkeypatch.setattr(native, ours, lambda *a, **k: (calls.append(ours), real_ours(*a, **k))[1])
    monkeypatch.setattr(_triton_utils, "INTERPRET", interpret)
    getattr(module, public)(*make_args())  # CPU tensors
    assert calls == [ours if ours is not None and native.available() else ref], calls


@pytest.mark.parametrize("T", [0, 1, 7])
@pytest.mark.parametrize("fused", [True, False])
def test_rope_cpu_path_equals_reference(T, fused):
    """The CPU path: q and k of a fused qkv output rotated as one view (or apart), its cached tables and rows
    refreshed when the positions change in place or another model's tables come."""
    g = torch.Generator().manual_seed(T)
    for theta in (10000.0, 500000.0):  # a second model's tables: not the first's cache
        cos, sin = rope_cos_sin(rope_inv_freq(16, theta, None), 64)
        pos = torch.randint(0, 64, (T,), generator=g)
        for _ in range(2):
            qkv = torch.randn(T, 6 * 16, generator=g)
            a, b = qkv.clone(), qkv.clone()
            if fused:
                q, k = a[:, :64].view(T, 4, 16), a[:, 64:80].view(T, 1, 16)
            else:
                q, k = a[:, :64].view(T, 4, 16), a[:, 80:].view(T, 1, 16)  # k not right after q
            rope.apply_rope(q, k, pos, cos, sin)
            q2, k2 = (b[:, :64].view(T, 4, 16), b[:, 64:80].view(T, 1, 16) if fused else b[:, 80:].view(T, 1, 16))
            rope.apply_rope_inplace_ref(q2, k2, pos, cos, sin)
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)  # v and the rest untouched
            pos.add_(1).remainder_(64)  # in place: the next round must gather new rows


def test_lazy_package_exports():
    import sgnb.kernels as kernels

    for name in ("rms_norm", "fused_add_rms_norm", "apply_rope", "silu_and_mul", "store_kv", "apply_token_bitmask"):
        assert callable(getattr(kernels, name)), name
    with pytest.raises(AttributeError):
        _ = kernels.no_such_kernel


def test_modules_import_and_run_without_triton():
    """With triton unimportable every module imports and its dispatcher runs the torch reference."""
    code = """
import sys
sys.modules["triton"] = None  # import triton -> ImportError
import torch
from sgnb.kernels import _triton_utils
from sgnb.kernels import activation, bitmask, kv_store, norm, rope
assert not _triton_utils.HAS_TRITON
x, w = torch.randn(3, 8), torch.randn(8)
assert torch.equal(norm.rms_norm(x, w, 1e-5), norm.rms_norm_ref(x, w, 1e-5))
assert activation.silu_and_mul(torch.randn(2, 8)).shape == (2, 4)
q, k = torch.randn(2, 2, 8), torch.randn(2, 1, 8)
cos, sin = rope.rope_cos_sin(rope.rope_inv_freq(8, 10000.0, None), 4)
rope.apply_rope(q, k, torch.tensor([0, 3]), cos, sin)
kb, vb = torch.zeros(4, 1, 8), torch.zeros(4, 1, 8)
kv_store.store_kv(kb, vb, torch.tensor([1, 3]), k, k)
logits = torch.zeros(1, 40)
bitmask.apply_token_bitmask(logits, torch.tensor([[1]], dtype=torch.int32))
assert logits[0, 0] == 0 and logits[0, 1:].eq(float("-inf")).all()
"""
    # (SGNB_NATIVE=0: our C kernels off too, so that float32 CPU tensors take the torch references here)
    env = {**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}, "SGNB_NATIVE": "0"}
    subprocess.run([sys.executable, "-P", "-c", code], check=True, env=env, timeout=120)  # -P: the installed sgnb, not ./sgnb
