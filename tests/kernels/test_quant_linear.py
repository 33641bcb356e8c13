"""Weight-quantized linears (kernels/quant_linear.py) against their torch reference and the fp32 layer."""

from __future__ import annotations

import pytest
import torch
from quant_weights import q4_0_weight
from torch import nn

from sgnb.kernels.quant_linear import (
    SMALL_M,
    QuantLinear,
    dequantize,
    quant_linear_ref,
    quantize_int4,
    quantize_int8,
    quantize_linears,
)


def _linear(n: int, k: int, bias: bool, seed: int) -> nn.Linear:
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) * 0.05)
        if bias:
            lin.bias.copy_(torch.randn(n, generator=g))
    return lin


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantization_round_trip(mode):
    w = torch.randn(96, 128, generator=torch.Generator().manual_seed(0)) * 0.05
    if mode == "int8":
        q, scale = quantize_int8(w)
        packed = {"q": q, "scale": scale}
        assert q.dtype == torch.int8 and q.abs().max() <= 127
        bound = scale[:, None] / 2  # half a step per element
    else:
        q, scale, zero = quantize_int4(w)
        packed = {"q": q, "scale": scale, "zero": zero}
        assert q.min() >= 0 and q.max() <= 15
        bound = scale.repeat_interleave(32, dim=1) / 2
    err = (dequantize(mode, packed) - w).abs()
    assert (err <= bound + 1e-7).all()
    assert err.max() > 0  # it is quantized


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m", [1, 3, SMALL_M, SMALL_M + 1, 40])
def test_layer_equals_reference_and_stays_close_to_fp32(mode, bias, m):
    lin = _linear(160, 192, bias, seed=m)
    layer = QuantLinear(lin, mode)
    w = lin.weight.detach()
    packed = dict(zip(("q", "scale"), quantize_int8(w))) if mode == "int8" else \
        dict(zip(("q", "scale", "zero"), quantize_int4(w)))
    x = torch.randn(m, 192, generator=torch.Generator().manual_seed(100 + m))
    got = layer(x)
    assert got.shape == (m, 160) and got.dtype == torch.float32
    ref = quant_linear_ref(x, mode, packed, lin.bias)
    # both paths (packed kernel for <= SMALL_M rows, bf16 GEMM above) multiply by the same quantized weights
    torch.testing.assert_close(got, ref, atol=3e-2, rtol=2e-2)
    exact = lin(x)
    rel = ((got - exact).norm() / exact.norm()).item()
    assert rel < (0.02 if mode == "int8" else 0.12), rel


@pytest.mark.parametrize("native", [False, True], ids=["avx2", "native-bf16"])
def test_bf16_layer_takes_float32_for_many_rows_without_native_bf16(monkeypatch, native):
    """A "bf16" layer (a head no lossless form holds) multiplies its bf16 weights; where the CPU has no native bf16
    (a bf16 GEMM runs row by row there) it takes their exact float32 copy above BF16_SMALL_M rows; both equal the
    bf16-rounded weight's product, whichever path a row count takes."""
    from sgnb.kernels import quant_linear as ql

    monkeypatch.setattr(ql, "native_bf16", lambda: native)
    lin = _linear(96, 64, False, seed=7)
    layer = QuantLinear(lin, "bf16")
    w16 = lin.weight.detach().to(torch.bfloat16)
    assert torch.equal(layer.weight_bf16, w16)
    if native:
        assert layer.small_m == 0 and layer.weight_dense is layer.weight_bf16
    else:
        assert layer.small_m == ql.BF16_SMALL_M and layer.weight_dense.dtype == torch.float32
        assert torch.equal(layer.weight_dense, w16.float())  # the same weights, exactly
    for m in (1, ql.BF16_SMALL_M, ql.BF16_SMALL_M + 1, 40):
        x = torch.randn(m, 64, generator=torch.Generator().manual_seed(m))
        want = x.to(torch.bfloat16).float() @ w16.float().t()  # bf16 activations on the bf16 path
        tol = 2e-2 if native or m <= layer.small_m else 1e-5
        torch.testing.assert_close(layer(x), x @ w16.float().t() if tol == 1e-5 else want, atol=tol, rtol=tol)


def test_quantize_linears_replaces_named_layers_and_keeps_a_tied_embedding():
    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(64, 32)
            self.block = nn.ModuleDict({"qkv_proj": nn.Linear(32, 96), "other": nn.Linear(32, 32)})
            self.lm_head = nn.Linear(32, 64, bias=False)
            self.lm_head.weight = self.embed.weight  # tied

    m = Tiny()
    table = m.embed.weight.detach().clone()
    # random weights are not on a 4-bit grid: the layer takes int8 as asked, the head bf16 (its auto choice)
    assert quantize_linears(m, "int8", ("qkv_proj", "lm_head")) == {"int8": 1, "bf16": 1}
    assert isinstance(m.block["qkv_proj"], QuantLinear) and isinstance(m.lm_head, QuantLinear)
    assert m.block["qkv_proj"].mode == "int8" and m.lm_head.mode == "bf16"
    assert isinstance(m.block["other"], nn.Linear)
    assert torch.equal(m.embed.weight, table)  # the embedding lookup table is untouched


def test_auto_takes_int4_exactly_where_weights_sit_on_a_4bit_grid():
    from sgnb.kernels.quant_linear import choose_mode, int4_is_lossless

    w = torch.randn(64, 128) * 0.05
    q, scale, zero = quantize_int4(w)
    on_grid = dequantize("int4", {"q": q, "scale": scale, "zero": zero})  # what a Q4 GGUF holds
    assert int4_is_lossless(on_grid) and not int4_is_lossless(w)
    assert choose_mode(on_grid, "auto", head=False) == "int4" and choose_mode(w, "auto", head=False) == "int8"
    assert choose_mode(w, "auto", head=True) == "bf16"
    assert choose_mode(torch.randn(8, 48), "int4", head=False) == "int8"  # K not a multiple of the group


class _Layers(nn.Module):
    """Two blocks of a decoder's linears on a 4-bit grid (int4 under auto), a head on none (bf16) and a layer
    that is not quantized: the shapes of a model the quantized-weights cache holds."""

    def __init__(self, seed: int, hidden: int = 64) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.layers = nn.ModuleList()
        for _ in range(2):
            block = nn.ModuleDict({"qkv_proj": nn.Linear(hidden, 3 * hidden, bias=True),
                                   "down_proj": nn.Linear(2 * hidden, hidden, bias=False),
                                   "other": nn.Linear(hidden, hidden)})
            with torch.no_grad():
                for lin in block.values():
                    q, scale, zero = quantize_int4(torch.randn(lin.weight.shape, generator=g) * 0.05)
                    lin.weight.copy_(dequantize("int4", {"q": q, "scale": scale, "zero": zero}))
            self.layers.append(block)
        self.lm_head = nn.Linear(hidden, 100, bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(torch.randn(100, hidden, generator=g))


def test_quantized_weights_cache_gives_the_same_layers_and_ignores_a_foreign_file(tmp_path, caplog, monkeypatch):
    """A load that finds the cache builds every layer from it (same modes, the same packed and dense weights, the
    same outputs) without quantizing; a file of other shapes, or a damaged one, is quantized again and
    rewritten."""
    import sgnb.kernels.quant_linear as ql

    monkeypatch.setattr(ql, "CACHE_MIN_SECONDS", 0.0)  # these layers quantize in milliseconds

    names = ("qkv_proj", "down_proj", "lm_head")
    cache = tmp_path / "q" / "model.safetensors"
    first = _Layers(seed=0)
    counts = quantize_linears(first, "auto", names, cache=cache)
    assert counts == {"int4": 4, "bf16": 1} and cache.is_file()
    assert isinstance(first.layers[0]["other"], nn.Linear)  # not named: not quantized
    calls = []
    real = ql.quantize_weight
    ql.quantize_weight = lambda *a, **k: calls.append(a) or real(*a, **k)
    try:
        again = _Layers(seed=0)
        assert quantize_linears(again, "auto", names, cache=cache) == counts
    finally:
        ql.quantize_weight = real
    assert calls == []  # every layer came from the file
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    for a, b in zip(first.modules(), again.modules()):
        if isinstance(a, QuantLinear):
            assert isinstance(b, QuantLinear) and (a.mode, a.small_m) == (b.mode, b.small_m)
            assert all(torch.equal(s, t) for s, t in zip(a.packed_tensors(), b.packed_tensors()))
            assert torch.equal(a.weight_dense, b.weight_dense)
            assert (a.bias is None) == (b.bias is None) and (a.bias is None or torch.equal(a.bias, b.bias))
            xin = x if a.in_features == 64 else torch.cat([x, x], 1)
            assert torch.equal(a(xin), b(xin))
            big = xin.repeat(10, 1)  # above small_m: the dense copy
            assert torch.equal(a(big), b(big))
    # another model's shapes: quantized, and the file now holds this one
    other = _Layers(seed=0, hidden=96)
    assert quantize_linears(other, "auto", names, cache=cache) == counts
    assert other.lm_head.weight_dense.shape == (100, 96)
    reread = ql._read_cache(cache, {p: (m.out_features, m.in_features) for p, m in other.named_modules()
                                    if isinstance(m, QuantLinear)})
    assert reread is not None and len(reread) == 5
    # a damaged file: a warning, and the layers are quantized again
    cache.write_bytes(cache.read_bytes()[:200])
    with caplog.at_level("WARNING", logger="sgnb.kernels"):
        fresh = _Layers(seed=0)
        assert quantize_linears(fresh, "auto", names, cache=cache) == counts
    assert "ignoring the quantized-weights cache" in caplog.text
    assert torch.equal(fresh.lm_head.weight_dense, first.lm_head.weight_dense)


def test_quantized_weights_cache_file_follows_the_checkpoint_and_options(tmp_path, monkeypatch):
    from sgnb.engine.model_loader import ModelSource, quantized_weights_cache, resolve_model

    monkeypatch.setenv("SGNB_CACHE_DIR", str(tmp_path / "cache"))
    ckpt = tmp_path / "my model"
    ckpt.mkdir()
    (ckpt / "model.safetensors").write_bytes(b"x" * 10)
    config = resolve_model("dummy:tiny").config
    source = ModelSource(name="org/my model", path=ckpt, config=config, dummy=False)
    a = quantized_weights_cache(source, "auto", "float32")
    assert a is not None and a.parent == tmp_path / "cache" / "quantized" and a.name.startswith("org-my-model-")
    assert quantized_weights_cache(source, "auto", "float32") == a
    assert quantized_weights_cache(source, "int8", "float32") != a
    (ckpt / "model.safetensors").write_bytes(b"y" * 11)  # a changed checkpoint
    assert quantized_weights_cache(source, "auto", "float32") != a
    assert quantized_weights_cache(ModelSource(name="d", path=None, config=config, dummy=True), "auto") is None


def test_quantized_weights_cache_skips_quick_quantizations_and_keeps_the_files_used_last(tmp_path, monkeypatch):
    import os

    import sgnb.kernels.quant_linear as ql

    names = ("qkv_proj", "down_proj", "lm_head")
    quantize_linears(_Layers(seed=0), "auto", names, cache=tmp_path / "quick.safetensors")
    assert not (tmp_path / "quick.safetensors").exists()  # milliseconds of work: no file
    monkeypatch.setattr(ql, "CACHE_MIN_SECONDS", 0.0)
    monkeypatch.setattr(ql, "CACHE_KEEP", 3)
    for i in range(4):
        (tmp_path / f"old{i}.safetensors").write_bytes(b"x")
        os.utime(tmp_path / f"old{i}.safetensors", (1000 + i, 1000 + i))
    quantize_linears(_Layers(seed=0), "auto", names, cache=tmp_path / "new.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new.safetensors", "old2.safetensors", "old3.safetensors"]
    # a read makes a file the most recently used: the next write prunes another
    os.utime(tmp_path / "new.safetensors", (2000, 2000))
    quantize_linears(_Layers(seed=0), "auto", names, cache=tmp_path / "new.safetensors")  # a hit
    monkeypatch.setattr(ql, "CACHE_KEEP", 2)
    quantize_linears(_Layers(seed=1, hidden=96), "auto", names, cache=tmp_path / "other.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new.safetensors", "other.safetensors"]


def test_a_layer_whose_checkpoint_is_its_stored_form_keeps_the_checkpoints_tensor_as_its_dense_copy(tmp_path,
                                                                                                    monkeypatch):
    """Weights that came from a Q4_0 GGUF (w = d * (q - 8), d a float16, every group using codes 0 and 15) are
    their int4 form exactly, as is a head in bf16 under "bf16": the dense copy is then the checkpoint's own tensor
    (no second copy, nothing rebuilt from the packed form), and the cache file says so, so that a load from it
    shares the checkpoint's tensors too. A layer whose int4 form only approximates it (float16 scales) gets its
    rebuilt copy. Either way the dense copy equals the stored form's weights and the layer computes as before."""
    import sgnb.kernels.quant_linear as ql
    from sgnb.kernels import native
    from sgnb.kernels.quant_linear import dense_dtype, stored_dense

    monkeypatch.setattr(ql, "CACHE_MIN_SECONDS", 0.0)

    def model(seed: int) -> nn.Module:
        m = _Layers(seed=seed)
        with torch.no_grad():
            m.layers[0]["qkv_proj"].weight.copy_(q4_0_weight(192, 64, seed=3, d_span=0.01))
            m.lm_head.weight.copy_(m.lm_head.weight.bfloat16().float())
        return m

    names = ("qkv_proj", "down_proj", "lm_head")
    cache = tmp_path / "model.safetensors"
    exact_paths = {"layers.0.qkv_proj", "lm_head"}
    for attempt in ("quantized", "from the cache"):
        m = model(seed=0)
        checkpoint = {p: mod.weight.detach() for p, mod in m.named_modules() if isinstance(mod, nn.Linear)}
        counts = quantize_linears(m, "auto", names, cache=cache)
        assert counts == {"int4": 4, "bf16": 1}, attempt
        layers = {p: mod for p, mod in m.named_modules() if isinstance(mod, QuantLinear)}
        for path, layer in layers.items():
            stored = {"weight_bf16": layer.weight_bf16} if layer.mode == "bf16" else \
                dict(zip(("q4", "d4", "m4"), layer._native[1])) if native.available() else None
            # a CPU that multiplies bf16 natively (AVX-512 bf16, AMX) keeps a bf16 dense copy: the weights rounded
            # to bf16, converted, so not the same tensor
            dense = dense_dtype()
            if stored is not None:
                assert layer.weight_dense.dtype == dense, (attempt, path)
                assert torch.equal(layer.weight_dense, stored_dense(layer.mode, stored).to(dense)), (attempt, path)
            shared = layer.weight_dense.data_ptr() == checkpoint[path].data_ptr()
            assert shared == (path in exact_paths and dense == torch.float32), (attempt, path, layer.mode)
            if path in exact_paths:
                assert torch.equal(layer.weight_dense, checkpoint[path].to(dense)), (attempt, path)
        x = torch.randn(20, 64, generator=torch.Generator().manual_seed(1))  # 20 rows: the dense copies
        outs = [layers[p](x) for p in ("layers.0.qkv_proj", "lm_head")]
        if attempt == "quantized":
            first = outs
            meta_exact = ql._read_cache(cache, {p: (mod.out_features, mod.in_features) for p, mod in layers.items()})
            assert meta_exact is not None
            assert {p for p, (_, _, exact) in meta_exact.items() if exact} == exact_paths
        else:
            assert all(torch.equal(a, b) for a, b in zip(first, outs))
