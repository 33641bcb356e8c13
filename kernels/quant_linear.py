"""Weight-quantized linear layers for the CPU engine: int8 (per output channel) or int4 (groups of 32) weights for
decode-sized batches of rows, and a dense copy of the same weights for large ones (prefill).

Our own kernels (kernels/native.py: AVX2 integer GEMVs with the rows rounded to int8 per block, as llama.cpp
does) run "int4" and "q8" where they build; torch's weight-only kernels (bf16 activations) run int4 elsewhere,
and int8 always. "q8" (int8 in blocks of 32 along K, Q8_0's layout) is the head's mode when the head came from a
Q8_0 GGUF tensor (the default model's tied embedding), where it holds the weights exactly and reads half of a
bf16 head's bytes. Our int4 kernel is 2.2-3.2x torch's on the default model's shapes at one row and 1.2-1.6x
at 2-16 rows (AVX2 EPYC, 2026-12-01), so with it a layer keeps the packed path up to NATIVE_SMALL_M rows.

The dense copy is bf16 where the CPU multiplies bf16 natively (AVX512_BF16 / AMX) and float32 elsewhere: on
the AVX2 EPYC a bf16 GEMM converts every element and ran 4-9x slower than float32 at 16-256 rows (960 x 576 at
256 rows: 24.5 ms vs 2.7 ms). That holds for "bf16" layers too (a head that no lossless form holds: a checkpoint's
own weights): bf16 weights up to BF16_SMALL_M rows, their exact float32 copy above, one bf16 copy where the CPU
multiplies bf16 natively.

Why both: on a CPU a decode step is bound by the bytes of weights it reads (fp32 SmolLM2-135M: 540 MB per step),
and packed weights read 4x / 8x fewer, but many rows sharing the weights (prefill) are compute-bound, where a
dense GEMM wins. So a layer keeps the packed weights for calls of at most `small_m` rows and the dense copy for
larger ones (the dequantized quantized weights, so both paths compute with the same weights); activations stay
fp32 outside the layer. Measured earlier on a 2-core EPYC with AVX-512 bf16 (30 layers of SmolLM2 linears,
weights streamed from DRAM, torch's kernels): M=1 fp32 25.5 ms, bf16 11.6, int8 4.3, int4 2.8; M=16: 41 / 16 /
14.5 / 11.4; M=64: 101 / 33 / 47 / 41 (benchmarks/results/NOTES.md).

The torch reference (`quant_linear_ref`) dequantizes explicitly; the layer must equal it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

log = logging.getLogger("sgnb.kernels")

INT4_GROUP = 32
SMALL_M = 8  # rows up to which torch's packed kernels beat a dense GEMM (measured crossover ~8-16)
# rows up to which our kernels run a layer called on its own (the module path); the one-call forward
# (native.decode_layers) runs them up to native.MAX_ROWS, where no per-layer Python is left to save
NATIVE_SMALL_M = 16
# rows up to which a "bf16" layer multiplies its bf16 weights on a CPU without native bf16, and its float32 copy
# above: on the AVX2 EPYC a bf16 GEMM ran row by row (a 49152 x 576 head: 3.4 ms at 1 row, 51 ms at 16, 798 ms at
# 256) while float32 took 9 / 24 / 138 ms, crossing near 4-8 rows (2026-12-06)
BF16_SMALL_M = 4
MODES = ("int8", "int4", "q8", "bf16")
LOSSLESS_INT4 = 1e-4  # relative error under which int4 groups reproduce a weight (weights from a Q4 GGUF)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: (N, K) float -> int8 (N, K) and float32 scales (N,); w ~ q * scale."""
    scale = (w.abs().amax(dim=1).float() / 127.0).clamp(min=1e-12)  # (N,)
    q = torch.round(w.float() / scale[:, None]).clamp(-127, 127).to(torch.int8)  # (N, K)
    return q, scale


def quantize_int4(w: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int4 in groups of `group` along K: q in [0, 15] (N, K) int32, scales and zeros (N, K / group)
    float32 with w ~ (q - 8) * scale + zero (the convention of torch's int4 CPU kernel)."""
    N, K = w.shape
    assert K % group == 0, f"in_features {K} is not a multiple of the int4 group {group}"
    wg = w.float().view(N, K // group, group)  # (N, G, group)
    lo, hi = wg.amin(-1), wg.amax(-1)  # (N, G)
    scale = ((hi - lo) / 15.0).clamp(min=1e-12)
    q = torch.round((wg - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).view(N, K)
    return q, scale, lo + 8.0 * scale


def dequantize(mode: str, packed: dict[str, torch.Tensor]) -> torch.Tensor:
    """The float32 weight (N, K) the packed form stands for."""
    if mode == "int8":
        return packed["q"].float() * packed["scale"][:, None]
    q, scale, zero = packed["q"], packed["scale"], packed["zero"]
    N, K = q.shape
    g = q.view(N, K // INT4_GROUP, INT4_GROUP).float()  # (N, G, group)
    return ((g - 8.0) * scale[..., None] + zero[..., None]).view(N, K)


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512_BF16 or AMX): then a bf16 GEMM beats float32."""
    from sgnb.kernels import native

    flags = native.cpu_flags() or frozenset()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def dense_dtype() -> torch.dtype:
    """The dtype of a quantized layer's dense copy (its path for large batches): see the module docstring."""
    return torch.bfloat16 if native_bf16() else torch.float32


def quantize_weight(w: torch.Tensor, mode: str,
                    int4: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The stored form of weight `w` (N, K) in `mode`: the tensors QuantLinear runs on and the dense copy is
    rebuilt from (what the quantized-weights cache holds). "bf16": weight_bf16; "q8": q8, d8; "int8": q, scale;
    "int4": q4, d4, m4 (our kernel's packing) where kernels/native.py runs, else q (uint8 codes), scale, zero.
    `int4`: quantize_int4(w) when the caller has it already."""
    from sgnb.kernels import native

    if mode == "bf16":
        return {"weight_bf16": w.to(torch.bfloat16).contiguous()}
    if mode == "q8":
        q8, d8 = native.quantize_q8(w)
        return {"q8": q8, "d8": d8}
    if mode == "int8":
        q, scale = quantize_int8(w)
        return {"q": q, "scale": scale}
    q, scale, zero = quantize_int4(w) if int4 is None else int4
    if native.available():
        q4, d4, m4 = native.pack_q4(q, scale, zero - 8.0 * scale)
        return {"q4": q4, "d4": d4, "m4": m4}
    return {"q": q.to(torch.uint8), "scale": scale, "zero": zero}


def stored_linear(linear: nn.Linear, mode: str, weight: dict[str, torch.Tensor] | None = None
                  ) -> dict[str, torch.Tensor]:
    """A linear's stored form: its weight's (quantize_weight(..., mode), or `weight` when the caller made it
    already) and its bias in float32 ("bias", when it has one)."""
    stored = quantize_weight(linear.weight.detach(), mode) if weight is None else weight
    if linear.bias is not None:
        stored["bias"] = linear.bias.detach().float()
    return stored


def stored_shape(stored: dict[str, torch.Tensor]) -> tuple[int, int]:
    """(out_features, in_features) of a stored weight (quantize_weight's form)."""
    if "q4" in stored:
        return stored["q4"].shape[0], stored["q4"].shape[1] * 2
    w = stored.get("weight_bf16", stored.get("q8", stored.get("q")))
    assert w is not None, sorted(stored)
    return w.shape[0], w.shape[1]


def stored_dense(mode: str, stored: dict[str, torch.Tensor]) -> torch.Tensor:
    """The float32 weight (N, K) a stored form (quantize_weight's) stands for: what its layer's dense copy holds."""
    from sgnb.kernels import native

    if mode == "bf16":
        return stored["weight_bf16"].float()
    if mode == "q8":
        return native.dequantize_q8(stored["q8"], stored["d8"])
    if "q4" in stored:
        return native.unpack_q4(stored["q4"], stored["d4"], stored["m4"])
    return dequantize(mode, stored)


def quant_linear_ref(x: torch.Tensor, mode: str, packed: dict[str, torch.Tensor],
                     bias: torch.Tensor | None) -> torch.Tensor:
    """What QuantLinear computes for a small batch: bf16 activations times the dequantized weight, fp32 out."""
    y = x.to(torch.bfloat16).float() @ dequantize(mode, packed).t()
    return y if bias is None else y + bias.float()


class QuantLinear(nn.Module):
    """A drop-in for nn.Linear (weights (N, K)): packed int8/int4/q8 weights for <= small_m rows, a dense copy of
    the same weights above (`weight_dense`, dtype `dense_dtype()`). Input and output keep the caller's dtype
    (fp32 on CPU). Built from a linear (`QuantLinear(linear, mode)`) or from the stored form `quantize_weight`
    made (`QuantLinear.from_stored`: what the quantized-weights cache holds)."""

    def __init__(self, linear: nn.Linear | None, mode: str, small_m: int | None = None,
                 stored: dict[str, torch.Tensor] | None = None, dense_weight: torch.Tensor | None = None) -> None:
        super().__init__()
        assert mode in MODES, mode
        from sgnb.kernels import native

        if linear is not None:
            stored = stored_linear(linear, mode)
        assert stored is not None, "QuantLinear needs a linear or its stored form"
        self.mode = mode
        self.out_features, self.in_features = stored_shape(stored)
        self.bias = None if stored.get("bias") is None else nn.Parameter(stored["bias"].float(), requires_grad=False)
        dense = dense_dtype()
        # our kernel and its weights, where it runs this mode
        self._native: tuple[Callable[..., torch.Tensor], tuple[torch.Tensor, ...]] | None = None
        # the large-batch path multiplies by the SAME quantized weights (dequantized): a request's logits then
        # differ between batch sizes by rounding only, not by quantization error. `dense_weight`: those weights
        # when the caller has them (equal to stored_dense(mode, stored): the quantized-weights cache records
        # which layers' checkpoint weights are), so they are not rebuilt from the packed form
        assert dense_weight is None or dense_weight.shape == (self.out_features, self.in_features), (
            dense_weight.shape, self.out_features, self.in_features)
        if mode == "bf16":  # bf16 weights (half the bytes of fp32, no quantization grid)
            self.weight_bf16 = stored["weight_bf16"].contiguous()
            if dense == torch.bfloat16:  # one copy serves every size
                self.small_m, self.weight_dense = 0, self.weight_bf16
            else:  # no native bf16: a bf16 GEMM costs ~3.4 ms a row here; the same weights in float32 above
                self.small_m = BF16_SMALL_M if small_m is None else small_m
                self.weight_dense = (self.weight_bf16 if dense_weight is None else dense_weight).float().contiguous()
            return
        if mode == "q8":
            self._native = (native.q8_gemv, (stored["q8"], stored["d8"]))
        elif mode == "int8":
            self._w8, self._s8 = stored["q"], stored["scale"].to(torch.bfloat16)
        elif "q4" in stored:  # our kernel's form: w = q * d + m per block, d and m in float16
            self._native = (native.q4_gemv, (stored["q4"], stored["d4"], stored["m4"]))
        else:
            q, scale, zero = stored["q"].to(torch.int32), stored["scale"], stored["zero"]
            self._w4 = torch._convert_weight_to_int4pack_for_cpu(q, 1)
            self._sz4 = torch.stack([scale.t(), zero.t()], dim=-1).contiguous().to(torch.bfloat16)  # (G, N, 2)
        if small_m is None:
            small_m = NATIVE_SMALL_M if self._native is not None else SMALL_M
        self.small_m = small_m
        weight = stored_dense(mode, stored) if dense_weight is None else dense_weight
        self.weight_dense = weight.to(dense).contiguous()  # (N, K)

    @classmethod
    def from_stored(cls, mode: str, stored: dict[str, torch.Tensor], small_m: int | None = None,
                    dense_weight: torch.Tensor | None = None) -> QuantLinear:
        return cls(None, mode, small_m, stored, dense_weight)

    def packed_tensors(self) -> list[torch.Tensor]:
        """The tensors the packed path reads (for byte counts)."""
        if self._native is not None:
            return list(self._native[1])
        if self.mode == "bf16":
            return [self.weight_bf16]
        return [t for t in (getattr(self, a, None) for a in ("_w8", "_s8", "_w4", "_sz4")) if t is not None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # (M, K)
        if x2.shape[0] > self.small_m:
            y = nn.functional.linear(x2.to(self.weight_dense.dtype), self.weight_dense)
        elif self.mode == "bf16":
            y = nn.functional.linear(x2.to(torch.bfloat16), self.weight_bf16)
        elif self._native is not None:
            y = self._native[0](x2.float().contiguous(), *self._native[1])
        elif self.mode == "int8":
            y = torch._weight_int8pack_mm(x2.to(torch.bfloat16), self._w8, self._s8)
        else:
            y = torch._weight_int4pack_mm_for_cpu(x2.to(torch.bfloat16), self._w4, INT4_GROUP, self._sz4)
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        kernel = "ours" if self._native is not None else "torch's"
        return (f"in={self.in_features}, out={self.out_features}, {self.mode} ({kernel} kernel) <= {self.small_m} "
                f"rows, {str(self.weight_dense.dtype).removeprefix('torch.')} above")


def int4_is_lossless(w: torch.Tensor) -> bool:
    """Whether int4 groups reproduce `w` (relative error < LOSSLESS_INT4): true of weights that came from a
    4-bit GGUF (Q4_0 / Q4_1 dequantized), such as the default model's linears."""
    return _lossless_int4(w) is not None


def _lossless_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """quantize_int4(w) where it reproduces `w` (int4_is_lossless), else None."""
    if w.shape[1] % INT4_GROUP:
        return None
    q, scale, zero = quantize_int4(w)
    back = dequantize("int4", {"q": q, "scale": scale, "zero": zero})
    return (q, scale, zero) if (back - w.float()).norm() <= LOSSLESS_INT4 * w.float().norm() else None


def q8_is_lossless(w: torch.Tensor) -> bool:
    """Whether int8 blocks of 32 (Q8_0's rule) reproduce `w`: true of a weight that came from a Q8_0 GGUF tensor."""
    if w.shape[1] % INT4_GROUP:
        return False
    from sgnb.kernels import native

    back = native.dequantize_q8(*native.quantize_q8(w))
    return bool((back - w.float()).norm() <= LOSSLESS_INT4 * w.float().norm())


def choose_mode(w: torch.Tensor, requested: str, head: bool) -> str:
    """The mode for one weight. "auto": int4 where int4 is lossless; for the head, q8 where that is lossless and
    our kernel built (kernels/native.py), else bf16 (its logits are large: a 1% weight error, int8's per-row
    grid, moves logprobs by ~0.2); int8 for other layers."""
    return _choose(w, requested, head)[0]


def _choose(w: torch.Tensor, requested: str, head: bool) -> tuple[str, dict[str, torch.Tensor] | None]:
    """choose_mode's answer, and the stored weight when the choice made it already (a lossless int4 check
    quantizes the weight: it is not quantized twice)."""
    if requested == "auto":
        int4 = _lossless_int4(w)
        if int4 is not None:
            return "int4", quantize_weight(w, "int4", int4)
        if head:
            from sgnb.kernels import native

            return ("q8" if native.available() and q8_is_lossless(w) else "bf16"), None
        return "int8", None
    if requested == "int4" and w.shape[1] % INT4_GROUP:
        return "int8", None
    return requested, None


def named_linears(module: nn.Module, names: tuple[str, ...]) -> list[tuple[str, nn.Module, str, nn.Linear]]:
    """(path, parent, attribute name, linear) of every nn.Linear child of `module` named in `names`."""
    return [(f"{parent_name}.{name}".lstrip("."), parent, name, child)
            for parent_name, parent in module.named_modules() for name, child in parent.named_children()
            if name in names and isinstance(child, nn.Linear)]


def stored_forms(module: nn.Module, mode: str, names: tuple[str, ...], head: str = "lm_head",
                 cache: Path | None = None) -> dict[str, tuple[str, dict[str, torch.Tensor], bool]]:
    """Each nn.Linear child named in `names`, by path: (its mode, its stored form (quantize_weight's), whether its
    weight equals, bit for bit, what that form stands for (stored_dense)). The modes: `mode` ("int8" | "int4" |
    "q8" | "bf16" | "auto": see choose_mode), the head (`head`) "auto"'s choice whatever `mode` is (int4 or q8
    where lossless, else bf16).

    `cache`: a file of exactly these forms. When it holds them, nothing is quantized (the default model: 0.1 s
    instead of 3.4 s on 2 cores); otherwise they are made and, where that took CACHE_MIN_SECONDS or more, the file
    is written (atomically: concurrent loads are safe); the folder keeps the CACHE_KEEP files used last. The
    caller names the file by everything the result depends on (engine/models/registry.py: the weight files, the
    options)."""
    targets = named_linears(module, names)
    shapes = {path: (child.out_features, child.in_features) for path, _, _, child in targets}
    cached = _read_cache(cache, shapes) if cache is not None else None
    if cached is not None:
        return cached
    started = time.perf_counter()
    forms: dict[str, tuple[str, dict[str, torch.Tensor], bool]] = {}
    for path, _, name, child in targets:
        weight = child.weight.detach()
        chosen, made = _choose(weight, "auto" if name == head else mode, head=name == head)
        stored = stored_linear(child, chosen, made)
        forms[path] = (chosen, stored, torch.equal(stored_dense(chosen, stored), weight.float()))
    if cache is not None and time.perf_counter() - started >= CACHE_MIN_SECONDS:
        _write_cache(cache, forms)
    return forms


def quantize_linears(module: nn.Module, mode: str, names: tuple[str, ...], head: str = "lm_head",
                     small_m: int | None = None, cache: Path | None = None) -> dict[str, int]:
    """Replace every nn.Linear child whose attribute name is in `names` by a QuantLinear of its stored form
    (stored_forms(module, mode, names, head, cache): the modes, and the cache file), in place; returns how many
    layers took each mode. A tied weight (lm_head = embedding) stays the embedding's: the head gets its own
    packed copy. small_m: see QuantLinear (None: the packed kernel's own limit). A layer whose checkpoint weight
    is exactly what its stored form stands for (every layer of the default model: its weights came from Q4_1 /
    Q8_0 GGUF tensors) keeps that tensor as its dense copy instead of one rebuilt from the packed form (that took 1.0 s
    of the default model's 1.7 s load)."""
    forms = stored_forms(module, mode, names, head, cache)
    counts: dict[str, int] = {}
    for path, parent, name, child in named_linears(module, names):
        chosen, stored, exact = forms[path]
        setattr(parent, name, QuantLinear.from_stored(chosen, stored, small_m, child.weight.detach() if exact else None))
        counts[chosen] = counts.get(chosen, 0) + 1
    return counts


# ---- the quantized-weights cache ----------------------------------------------------------------------------
# a file of one model's stored weights: tensors "<layer path>/<field>", metadata {"modes": {layer path: mode},
# "exact": [the layer paths whose checkpoint weight equals their stored form's dense weight]}
CACHE_FORMAT = "sgnb-quantized-2"
CACHE_MIN_SECONDS = 0.5  # a quantization quicker than this is not worth a file (tiny and test checkpoints)
CACHE_KEEP = 8  # files the folder keeps, the least recently used removed first (a read refreshes a file's mtime)


def _read_cache(cache: Path, shapes: dict[str, tuple[int, int]]
                ) -> dict[str, tuple[str, dict[str, torch.Tensor], bool]] | None:
    """The cache's layers by path, (mode, stored form, whether the checkpoint's weight is its dense weight), when
    it holds exactly the layers of `shapes` ({path: (out, in)}) with those shapes; None (quantize them)
    otherwise."""
    import json

    from safetensors import safe_open

    if not cache.is_file():
        return None
    try:
        with safe_open(str(cache), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            modes = json.loads(meta.get("modes", "{}"))
            if meta.get("format") != CACHE_FORMAT or sorted(modes) != sorted(shapes):
                return None
            exact = set(json.loads(meta.get("exact", "[]")))
            layers: dict[str, tuple[str, dict[str, torch.Tensor], bool]] = {p: (modes[p], {}, p in exact)
                                                                            for p in shapes}
            for key in f.keys():
                path, _, field = key.rpartition("/")
                layers[path][1][field] = f.get_tensor(key)
        if any(stored_shape(stored) != shapes[p] for p, (_, stored, _) in layers.items()):
            return None
    except Exception as e:  # noqa: BLE001 - a damaged or foreign file is quantized again, not an error
        log.warning("ignoring the quantized-weights cache %s (%s: %s)", cache, type(e).__name__, e)
        return None
    with contextlib.suppress(OSError):
        os.utime(cache)  # used now: the last file pruning removes
    return layers


def _write_cache(cache: Path, layers: dict[str, tuple[str, dict[str, torch.Tensor], bool]]) -> None:
    """Write the layers' stored weights to `cache` atomically (a temporary file renamed into place); a cache
    that cannot be written is only logged."""
    import json
    import tempfile

    from safetensors.torch import save_file

    tensors = {f"{path}/{field}": t.contiguous()
               for path, (_, stored, _) in layers.items() for field, t in stored.items()}
    meta = {"format": CACHE_FORMAT, "modes": json.dumps({path: mode for path, (mode, _, _) in layers.items()}),
            "exact": json.dumps(sorted(path for path, (_, _, exact) in layers.items() if exact))}
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".tmp-{cache.name}-", dir=cache.parent)
        os.close(fd)
        try:
            save_file(tensors, tmp, metadata=meta)
            os.chmod(tmp, 0o644)
            os.replace(tmp, cache)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError as e:
        log.warning("could not write the quantized-weights cache %s: %s", cache, e)
    _prune(cache.parent)


def _prune(folder: Path) -> None:
    """Keep the CACHE_KEEP most recently used cache files of `folder` (another process may prune at once)."""
    def mtime(path: Path) -> float:
        try:
            return path.stat().st_mtime
        except OSError:
            return 0.0

    for old in sorted(folder.glob("*.safetensors"), key=mtime, reverse=True)[CACHE_KEEP:]:
        with contextlib.suppress(OSError):
            old.unlink()
