"""Our C kernels (kernels/csrc/cpu_decode.c, built by kernels/native.py): the int8 and int4 GEMVs against a torch
reference that rounds the rows the same way, the float32 GEMV against float64, the layers that use them
(QuantLinear's modes, F32Linear), and the paged decode attention."""

from __future__ import annotations

import shutil
import time

import pytest
import torch
from quant_weights import q4_0_weight
from torch import nn

from sgnb.kernels import native
from sgnb.kernels.dense_linear import F32_SMALL_M
from sgnb.kernels.quant_linear import NATIVE_SMALL_M, QuantLinear, choose_mode, q8_is_lossless, quantize_int4

needs_native = pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.unavailable_reason()}")


def test_builds_wherever_there_is_a_compiler():
    """CI and these machines have gcc and AVX2: the kernel must build, not fall back silently."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler here")
    assert native.available(), native.unavailable_reason()


def _q8_weight(n: int, k: int, seed: int) -> torch.Tensor:
    """A weight on Q8_0's grid (what a Q8_0 GGUF tensor dequantizes to)."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    q, d = native.quantize_q8(w)
    return (q.float().view(n, -1, native.BLOCK) * d[..., None]).view(n, k)


@needs_native
def test_rows_round_to_int8_per_block():
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(1)) * 4
    xq, dx = native.quantize_rows(x)
    assert xq.dtype == torch.int8 and dx.shape == (3, 3)
    blocks = x.view(3, 3, 32)
    torch.testing.assert_close(dx, blocks.abs().amax(-1) / 127)
    assert (xq.view(3, 3, 32).abs().amax(-1) == 127).all()  # each block's largest element maps to +-127
    err = (xq.float().view(3, 3, 32) * dx[..., None] - blocks).abs()
    assert (err <= dx[..., None] / 2 + 1e-6).all()  # round to nearest


@needs_native
@pytest.mark.parametrize("m", [1, 2, 5, 7, native.MAX_ROWS])
@pytest.mark.parametrize("n,k", [(7, 32), (200, 576), (1031, 1536)])
def test_q8_gemv_equals_reference(m, n, k, isa):
    w = _q8_weight(n, k, seed=n + k)
    q, d = native.quantize_q8(w)
    assert q8_is_lossless(w)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    y = native.q8_gemv(x, q, d)
    xq, dx = native.quantize_rows(x)
    x_seen = (xq.float().view(m, -1, 32) * dx[..., None]).view(m, k)
    ref = x_seen.double() @ w.double().t()  # what the integer dot products compute, in float64
    torch.testing.assert_close(y.double(), ref, atol=1e-4, rtol=1e-4)
    exact = x @ w.t()
    assert ((y - exact).norm() / exact.norm()) < 0.02  # the rows' 8-bit rounding, no more


def _rows_seen(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels see it: rounded to int8 per block of 32."""
    xq, dx = native.quantize_rows(x)
    return (xq.float().view(x.shape[0], -1, 32) * dx[..., None]).view_as(x)


@pytest.fixture(params=native.ISAS)
def isa(request):
    """Each of the several-row GEMVs' kernel sets this CPU has (AVX2 everywhere; AVX-512 VNNI where present)."""
    if not native.available():
        pytest.skip(f"native kernels: {native.unavailable_reason()}")
    before = native.isa()
    if native.set_isa(request.param) != request.param:
        native.set_isa(before)
        pytest.skip(f"the CPU lacks {request.param}")
    yield request.param
    native.set_isa(before)


@needs_native
@pytest.mark.parametrize("m", [1, 2, 5, 7, native.MAX_ROWS])  # rows in fours and a last 1, 2 or 3
@pytest.mark.parametrize("n,k", [(7, 32), (200, 576), (1030, 1536), (1032, 64), (12, 96), (9, 224)])
def test_q4_gemv_equals_reference(m, n, k, isa):
    """Widths that are and are not multiples of the one-row kernel's four columns (its tiles), one block and
    many, an even and an odd number of blocks (a tile's last block alone)."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)) * 0.05
    q, scale, zero = quantize_int4(w)
    packed = native.pack_q4(q, scale, zero - 8.0 * scale)
    assert packed[0].shape == (n, k // 2) and packed[1].dtype == torch.float16
    w_held = native.unpack_q4(*packed)
    assert torch.equal(native.q4_codes(packed[0]).int(), q)  # the codes survive packing; d and m round (fp16)
    assert ((w_held - w).abs() <= scale.repeat_interleave(32, 1) / 2 + 1e-3 * w.abs().max()).all()
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    y = native.q4_gemv(x, *packed)
    ref = _rows_seen(x).double() @ w_held.double().t()
    torch.testing.assert_close(y.double(), ref, atol=1e-4, rtol=1e-4)


def _q4_case(n: int, k: int, seed: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    q, scale, zero = quantize_int4(w)
    packed = native.pack_q4(q, scale, zero - 8.0 * scale)
    return packed, native.unpack_q4(*packed)


@needs_native
def test_thread_pool_across_thread_counts_and_concurrent_callers():
    """The GEMVs' threads (cpu_decode.c's pool): more threads than columns (workers sitting a job out, then
    taking the next), thread counts changing from call to call, and two Python threads calling at once (one
    runs on the pool, the other serially): every result equals the single-threaded one."""
    import threading

    cases = [(_q4_case(n, 96, n), torch.randn(m, 96, generator=torch.Generator().manual_seed(m)))
             for n, m in [(6, 1), (5, 1), (13, 2), (64, 1), (9, 7)]]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = [native.q4_gemv(x, *packed) for (packed, _), x in cases]
        errors: list[str] = []

        def hammer(rounds: int) -> None:
            for r in range(rounds):
                for i, ((packed, _), x) in enumerate(cases):
                    got = native.q4_gemv(x, *packed)
                    if not torch.equal(got, want[i]):
                        errors.append(f"case {i} round {r}: max diff {(got - want[i]).abs().max().item()}")

        for threads in (4, 2, 3, 6):
            torch.set_num_threads(threads)
            hammer(30)
        torch.set_num_threads(4)
        workers = [threading.Thread(target=hammer, args=(40,)) for _ in range(2)]
        for t in workers:
            t.start()
        for t in workers:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in workers), "a caller hung"
        assert not errors, errors[:5]
    finally:
        torch.set_num_threads(before)


@needs_native
def test_thread_pool_in_a_forked_child():
    """A child forked after the pool's threads started and went to sleep (it has none of them, and inherits the
    sleep condition with the parent's waiters in it) starts its own."""
    import os

    packed, _ = _q4_case(64, 96, 3)
    x = torch.randn(1, 96, generator=torch.Generator().manual_seed(0))
    want = native.q4_gemv(x, *packed)  # the pool is up in this process now
    time.sleep(0.05)  # and its worker asleep (it spins 300 us), waiting on the condition the child inherits
    pid = os.fork()
    if pid == 0:  # the child: exit code 0 only if the GEMV finished and matched
        ok = False
        try:
            ok = torch.equal(native.q4_gemv(x, *packed), want)
        finally:
            os._exit(0 if ok else 1)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail("the forked child's GEMV hung")


@needs_native
def test_q8_gemv_rejects_what_it_cannot_run():
    q, d = native.quantize_q8(_q8_weight(8, 64, seed=0))
    with pytest.raises(AssertionError):
        native.q8_gemv(torch.randn(native.MAX_ROWS + 1, 64), q, d)
    with pytest.raises(AssertionError):
        native.q8_gemv(torch.randn(2, 64).t().contiguous().t(), q, d)  # not contiguous


@needs_native
@pytest.mark.parametrize("m", [1, NATIVE_SMALL_M, NATIVE_SMALL_M + 3])
def test_q8_layer_holds_a_q8_weight_exactly(m):
    """The head's mode: decode-sized batches run the kernel, larger ones the dense copy of the same weights."""
    lin = nn.Linear(576, 300, bias=False)
    with torch.no_grad():
        lin.weight.copy_(_q8_weight(300, 576, seed=3))
    assert choose_mode(lin.weight, "auto", head=True) == "q8"
    assert choose_mode(torch.randn(300, 576), "auto", head=True) == "bf16"  # off the grid: not lossless
    layer = QuantLinear(lin, "q8")
    x = torch.randn(m, 576, generator=torch.Generator().manual_seed(m))
    got, exact = layer(x), lin(x)
    assert got.shape == (m, 300) and got.dtype == torch.float32
    rel = ((got - exact).norm() / exact.norm()).item()
    assert rel < 0.02, rel
    assert layer.small_m == NATIVE_SMALL_M
    if m <= layer.small_m:
        torch.testing.assert_close(got, native.q8_gemv(x, *native.quantize_q8(lin.weight)))
    else:
        torch.testing.assert_close(got, x @ layer.weight_dense.float().t(), atol=1e-2, rtol=1e-2)


@needs_native
@pytest.mark.parametrize("m", [1, 4, NATIVE_SMALL_M, NATIVE_SMALL_M + 1])
def test_int4_layer_runs_our_kernel_up_to_its_rows_and_the_dense_copy_above(m):
    lin = nn.Linear(576, 200, bias=True)
    layer = QuantLinear(lin, "int4")
    assert layer.small_m == NATIVE_SMALL_M and "ours" in layer.extra_repr()
    x = torch.randn(m, 576, generator=torch.Generator().manual_seed(m))
    got = layer(x)
    w_held = layer.weight_dense.float()  # (bf16 where the CPU has native bf16: rounded)
    if m <= layer.small_m:
        ref = _rows_seen(x) @ native.unpack_q4(*layer._native[1]).t() + lin.bias.detach()
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    else:
        torch.testing.assert_close(got, x @ w_held.t() + lin.bias.detach(), atol=1e-2, rtol=1e-2)


@needs_native
@pytest.mark.parametrize("n,k", [(7, 32), (200, 576), (1031, 1536), (9, 8)])
def test_f32_gemv_equals_float64_and_each_row_its_own(n, k):
    """Against float64; and a row's result is bit for bit its result alone, whatever rows sit beside it and
    however many threads split the columns (the exact engine's logits do not change with the batch)."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k))
    x = torch.randn(native.MAX_ROWS + 5, k, generator=torch.Generator().manual_seed(k))
    ref = x.double() @ w.double().t()
    threads = torch.get_num_threads()
    try:
        for nth in (1, 3):
            torch.set_num_threads(nth)
            y = native.f32_gemv(x, w)
            torch.testing.assert_close(y.double(), ref, atol=1e-4, rtol=1e-5)
            for lo, hi in ((0, 1), (3, 4), (5, 12), (1, 17), (20, 21)):
                assert torch.equal(native.f32_gemv(x[lo:hi].contiguous(), w), y[lo:hi]), (nth, lo, hi)
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(AssertionError):
        native.f32_gemv(torch.randn(2, 12), torch.randn(3, 12))  # K not a multiple of 8
    with pytest.raises(AssertionError):
        native.f32_gemv(x.t().contiguous().t(), w)  # x not contiguous


@needs_native
@pytest.mark.parametrize("m", [1, 5, F32_SMALL_M, F32_SMALL_M + 1])
def test_f32_layer_runs_our_gemv_up_to_its_rows_on_the_linears_own_weights(m):
    from sgnb.kernels.dense_linear import F32Linear, use_f32_gemv

    model = nn.Sequential()
    model.add_module("qkv_proj", nn.Linear(96, 40, bias=True))
    model.add_module("other", nn.Linear(96, 40))
    model.add_module("lm_head", nn.Linear(96, 40, bias=False))
    model.lm_head.weight = model.qkv_proj.weight  # tied
    assert use_f32_gemv(model, ("qkv_proj", "lm_head")) == 2
    layer = model.qkv_proj
    assert isinstance(layer, F32Linear) and type(model.other) is nn.Linear and "our GEMV" in layer.extra_repr()
    assert model.lm_head.weight is layer.weight  # still tied: the same Parameter, no copy
    x = torch.randn(m, 96, generator=torch.Generator().manual_seed(m))
    got = layer(x)
    exact = x @ layer.weight.detach().t() + layer.bias.detach()
    torch.testing.assert_close(got, exact, atol=1e-5, rtol=1e-5)
    if m <= F32_SMALL_M:
        assert torch.equal(got, native.f32_gemv(x, layer.weight.detach()) + layer.bias.detach())
    else:
        assert torch.equal(got, nn.functional.linear(x, layer.weight, layer.bias))
    assert layer(x.view(m, 1, 96)).shape == (m, 1, 40)


@needs_native
@pytest.mark.parametrize("n,k", [(1, 32), (7, 64), (40, 576), (13, 1536)])
def test_qf32_gemv_equals_float64_and_each_row_its_own(n, k):
    """int8 codes with a float32 d and m per block: against float64 over the weights they stand for; a row's
    result is bit for bit its result alone, whatever rows sit beside it and however many threads split the
    columns (as f32_gemv's)."""
    g = torch.Generator().manual_seed(n * k)
    q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    d, m = torch.rand(n, k // 32, generator=g) * 0.01, torch.randn(n, k // 32, generator=g) * 0.1
    w = (q.float().view(n, -1, 32) * d[..., None] + m[..., None]).view(n, k)
    x = torch.randn(native.MAX_ROWS + 5, k, generator=g)
    ref = x.double() @ w.double().t()
    threads = torch.get_num_threads()
    try:
        for nth in (1, 3):
            torch.set_num_threads(nth)
            y = native.qf32_gemv(x, q, d, m)
            torch.testing.assert_close(y.double(), ref, atol=1e-4, rtol=1e-5)
            for lo, hi in ((0, 1), (3, 4), (5, 12), (1, 17), (20, 21)):
                assert torch.equal(native.qf32_gemv(x[lo:hi].contiguous(), q, d, m), y[lo:hi]), (nth, lo, hi)
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(AssertionError):
        native.qf32_gemv(x, q, d.double(), m)  # float32 scales


@needs_native
def test_weights_from_a_gguf_run_on_their_exact_codes_and_others_on_themselves():
    """A weight that is exactly an int4 (Q4_0's) or q8 (Q8_0's) form gets its codes (a quarter of its bytes),
    which stand for it bit for bit; its layer then computes what the float32 layer does. A float weight near that
    grid, or off it, keeps the float32 GEMV over itself."""
    from sgnb.kernels.dense_linear import F32Linear, exact_codes, may_have_exact_codes, use_f32_gemv
    from sgnb.kernels.quant_linear import stored_forms

    model = nn.Sequential()
    model.add_module("qkv_proj", nn.Linear(96, 64, bias=True))
    model.add_module("down_proj", nn.Linear(96, 64, bias=False))
    model.add_module("lm_head", nn.Linear(96, 80, bias=False))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        model.qkv_proj.weight.copy_(q4_0_weight(64, 96, seed=1))
        model.down_proj.weight.copy_(q4_0_weight(64, 96, seed=2) + 1e-6)  # near the grid, not on it
        model.lm_head.weight.copy_(native.dequantize_q8(*native.quantize_q8(torch.randn(80, 96, generator=g))))
    names = ("qkv_proj", "down_proj", "lm_head")
    assert may_have_exact_codes(model, names)
    forms = stored_forms(model, "auto", names)
    assert {p: (mode, exact) for p, (mode, _, exact) in forms.items()} == {
        "qkv_proj": ("int4", True), "down_proj": ("int4", False), "lm_head": ("q8", True)}
    weights = {p: getattr(model, p).weight.detach().clone() for p in names}
    for path, (mode, stored, exact) in forms.items():
        q, d, m = exact_codes(mode, stored)
        assert q.dtype == torch.int8 and q.shape == weights[path].shape and d.shape == m.shape == (q.shape[0], 3)
        # one fma per weight (float64 holds q * d + m exactly here): the weight itself where the form is exact
        rebuilt = (q.double().view(q.shape[0], 3, 32) * d.double()[..., None] + m.double()[..., None]).float()
        assert torch.equal(rebuilt.view(q.shape), weights[path]) == exact, path
    assert use_f32_gemv(model, names, forms) == 3
    for path in names:
        layer = getattr(model, path)
        assert isinstance(layer, F32Linear) and (layer.codes is not None) == (path != "down_proj"), path
        assert ("exact int8 codes" in layer.extra_repr()) == (layer.codes is not None)
        for rows in (1, 6):
            x = torch.randn(rows, 96, generator=g)
            exact = x.double() @ weights[path].double().t()
            if layer.bias is not None:
                exact += layer.bias.double()
            torch.testing.assert_close(layer(x).double(), exact, atol=1e-5, rtol=1e-5)
        assert native.linear_fields(layer)[0] == (33 if layer.codes is not None else 32)
    float_model = nn.Sequential()
    float_model.add_module("qkv_proj", nn.Linear(96, 64))
    assert not may_have_exact_codes(float_model, names)


def _slot_table(lens: list[int], pool: int, seed: int, fragmented: bool) -> torch.Tensor:
    """req_to_token rows of the given lengths: random distinct slots, or one contiguous run per request."""
    g = torch.Generator().manual_seed(seed)
    table = torch.zeros(len(lens) + 2, max(lens) + 8, dtype=torch.int64)
    perm = torch.randperm(pool - 1, generator=g) + 1
    at = 0
    for i, n in enumerate(lens):
        table[i + 1, :n] = perm[at: at + n] if fragmented else torch.arange(at + 1, at + 1 + n)
        at += n
    return table


@needs_native
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 16), (16, 2, 128)])
@pytest.mark.parametrize("fragmented", [False, True])
def test_paged_decode_equals_reference(heads, kv_heads, dim, fragmented):
    """One query per request over its keys through the slot table: lengths around the kernel's 256-key chunks,
    a request starting past its first keys (a shared prefix read elsewhere), against torch (float64)."""
    lens = [1, 7, 255, 256, 257, 1100]
    pool = sum(lens) + 50
    g = torch.Generator().manual_seed(heads)
    k_buf, v_buf = torch.randn(pool, kv_heads, dim, generator=g), torch.randn(pool, kv_heads, dim, generator=g)
    table = _slot_table(lens, pool, seed=dim, fragmented=fragmented)
    rows = torch.arange(1, len(lens) + 1)
    starts = torch.tensor([0, 3, 0, 0, 100, 64])
    own = torch.tensor(lens) - starts
    q = torch.randn(len(lens), heads, dim, generator=g)
    scale = dim**-0.5
    out, lse = native.paged_decode(q, k_buf, v_buf, table, rows, starts, own, scale)
    G = heads // kv_heads
    for b in range(len(lens)):
        slots = table[rows[b], starts[b]: starts[b] + own[b]]
        k = k_buf[slots].double().repeat_interleave(G, dim=1)  # (L, H, D)
        v = v_buf[slots].double().repeat_interleave(G, dim=1)
        s = torch.einsum("hd,lhd->hl", q[b].double(), k) * scale  # (H, L)
        torch.testing.assert_close(lse[b].double(), torch.logsumexp(s, -1), atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(out[b].double(), torch.einsum("hl,lhd->hd", s.softmax(-1), v),
                                   atol=2e-5, rtol=1e-4)


@needs_native
def test_paged_decode_with_no_keys_gives_an_empty_partial():
    k_buf = torch.randn(10, 1, 8)
    table = torch.arange(10).view(1, 10)
    out, lse = native.paged_decode(torch.randn(1, 2, 8), k_buf, k_buf.clone(), table, torch.tensor([0]),
                                   torch.tensor([4]), torch.tensor([0]), 0.5)
    assert torch.isneginf(lse).all() and (out == 0).all()


@needs_native
@pytest.mark.parametrize("fragmented", [False, True])
@pytest.mark.parametrize("extend", [False, True])
def test_torch_backend_kernel_route_equals_the_reference(fragmented, extend):
    """The CPU backend with the kernel: lone requests and groups sharing a cached prefix (read once, a view
    when its slots are one run), decoding one token each or extending by a few (causal within the extend),
    against paged_attention_ref (the per-request torch reference)."""
    from sgnb.engine.attention.torch_backend import TorchAttention, _NativePlan
    from sgnb.engine.forward_batch import BatchSpec, ForwardBatch
    from sgnb.engine.kv_pool import KVCache
    from sgnb.kernels.attention import paged_attention_ref

    H, Hkv, D = 6, 2, 32
    # requests 1-3 share a 96-token prefix; 0 and 4 are alone (extends: own parts within NATIVE_MAX_OWN_KEYS)
    shared, own = 96, ([5, 40, 60, 1, 70] if extend else [5, 40, 300, 1, 70])
    lens = [own[0], shared + own[1], shared + own[2], shared + own[3], own[4]]
    pool = sum(lens) + 16
    cache = KVCache(pool, 1, Hkv, D, torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(7)
    cache.k_buffers[0][1:] = torch.randn(pool + 1, Hkv, D, generator=g)
    cache.v_buffers[0][1:] = torch.randn(pool + 1, Hkv, D, generator=g)
    table = _slot_table(lens, pool, seed=1, fragmented=fragmented)
    table[2, :shared] = table[4, :shared] = table[3, :shared]  # requests 1-3 (rows 2-4): request 2's prefix
    B = len(lens)
    ext = [3, 1, 7, 2, 5] if extend else [1] * B
    new = [table[i + 1, n - e: n] for i, (n, e) in enumerate(zip(lens, ext))]
    spec = BatchSpec(input_ids=[0] * sum(ext), out_cache_loc=torch.cat(new), req_pool_indices=list(range(1, B + 1)),
                     prefix_lens=[n - e for n, e in zip(lens, ext)], extend_lens=ext,
                     groups=[(0, 1, 0), (1, 3, shared), (4, 1, 0)])
    fb = ForwardBatch.build(spec, table, torch.device("cpu"))
    backend = TorchAttention(cache, H, Hkv, D)
    backend.init_forward_metadata(fb)
    assert isinstance(fb.attn_metadata, _NativePlan) and len(fb.attn_metadata.cascades) == 1
    prefix = fb.attn_metadata.cascades[0][2]
    assert isinstance(prefix, int) != fragmented  # a view when the prefix is one run of slots
    q = torch.randn(sum(ext), H, D, generator=g)

    class Layer:
        layer_id, scale = 0, D**-0.5

    got = backend.attend(q, Layer(), fb)
    want = paged_attention_ref(q, cache.k_buffers[0], cache.v_buffers[0], table, list(range(1, B + 1)),
                               [n - e for n, e in zip(lens, ext)], ext, D**-0.5)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    if extend:  # a lone request reading more keys of its own: torch's SDPA route (the view route's tuple)
        spec = BatchSpec(input_ids=[0] * 10, out_cache_loc=table[3, lens[2] - 10: lens[2]], req_pool_indices=[3],
                         prefix_lens=[lens[2] - 10], extend_lens=[10])
        fb = ForwardBatch.build(spec, table, torch.device("cpu"))
        backend.init_forward_metadata(fb)
        assert isinstance(fb.attn_metadata, tuple)


@needs_native
@pytest.mark.parametrize("rows", [1, 5, 300])  # (300 x 576: the parallel branch)
def test_elementwise_kernels_equal_the_torch_references(rows):
    """The module path's one-pass CPU kernels: RMSNorm (with the residual add, in place), rope on strided
    q / k views of a fused qkv row, SiLU x up."""
    from sgnb.kernels.activation import silu_and_mul_ref
    from sgnb.kernels.norm import fused_add_rms_norm_ref, rms_norm_ref
    from sgnb.kernels.rope import apply_rope_inplace_ref, rope_cos_sin, rope_inv_freq

    g = torch.Generator().manual_seed(rows)
    x, res, w = torch.randn(rows, 576, generator=g), torch.randn(rows, 576, generator=g), torch.randn(576, generator=g)
    torch.testing.assert_close(native.rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5), atol=1e-5, rtol=1e-5)
    res_ref = res.clone()
    want, _ = fused_add_rms_norm_ref(x, res_ref, w, 1e-5)
    got = native.rms_norm(x, w, 1e-5, res)
    torch.testing.assert_close(res, res_ref, atol=0, rtol=0)  # the add, in place, exactly
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)

    qkv = torch.randn(rows, 9 * 64 + 2 * 3 * 64, generator=g)
    q, k = qkv[:, : 9 * 64].view(rows, 9, 64), qkv[:, 9 * 64: 12 * 64].view(rows, 3, 64)
    cos, sin = rope_cos_sin(rope_inv_freq(64, 10000.0, None), 512)
    pos = torch.randint(0, 512, (rows,), generator=g)
    q_ref, k_ref = q.clone(), k.clone()
    apply_rope_inplace_ref(q_ref, k_ref, pos, cos, sin)
    v_before = qkv[:, 12 * 64:].clone()
    native.rope(q, k, pos, cos, sin)
    torch.testing.assert_close(q, q_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k, k_ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(qkv[:, 12 * 64:], v_before)  # v untouched

    gu = torch.randn(rows, 2 * 1536, generator=g) * 4
    torch.testing.assert_close(native.silu_mul(gu), silu_and_mul_ref(gu), atol=1e-5, rtol=1e-5)


@needs_native
def test_processes_that_start_together_compile_the_kernels_once(tmp_path):
    """Three processes load the C kernels from an empty cache at once: one compiles (the compiler here stands in
    for cc, copies the library this session built and says that it ran), the others wait on the cache folder's
    lock and load its library."""
    import os
    import stat
    import subprocess
    import sys

    built = native._need()._name  # the library this session compiled or found
    calls = tmp_path / "calls"
    cc = tmp_path / "cc"
    cc.write_text(f"""#!/bin/sh
if [ "$1" = "--version" ]; then echo "stand-in cc 1"; exit 0; fi
while [ "$1" != "-o" ]; do shift; done
echo x >> {calls}
sleep 1.5
cp {built} "$2"
""")
    cc.chmod(cc.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "CC": str(cc), "SGNB_CACHE_DIR": str(tmp_path / "cache")}
    script = "from sgnb.kernels import native; assert native.available(), native.unavailable_reason(); print('ok')"
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
             for _ in range(3)]
    assert [p.communicate(timeout=120)[0].strip() for p in procs] == ["ok"] * 3
    assert calls.read_text() == "x\n"
    assert [p.suffix for p in (tmp_path / "cache" / "native").iterdir()] == [".so"]  # no lock or temporary file
