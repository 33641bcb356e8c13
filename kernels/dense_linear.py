"""float32 linear layers on the CPU (the exact engine: `quantization="none"`): our GEMV (kernels/native.py
f32_gemv) for decode-sized batches of rows, torch's GEMM above, on the one weight tensor.

torch's float32 GEMM at a few rows runs far below both of a CPU's limits: on the 2-core AVX2 EPYC the default
model's layers at 6 rows took 2.1x their time at one row (15 GFLOP/s), though a step reads the same weights
at any row count. Our kernel reads each weight once per call and computes every row alike, so a row's result
does not depend on the rows beside it (a request's logits do not change with its batch) up to `small_m`
rows; above, a GEMM's compute per weight wins and torch's runs. The decode forward in one call
(native.decode_layers) takes these layers too (native.linear_fields).

A weight that came from a Q4_0 / Q4_1 / Q8_0 GGUF (the default model's: Q4_1 and Q8_0) is, bit for bit, int8
codes with a float32 scale and offset per block of 32 (`exact_codes`): there the GEMV reads those codes (1 byte a
weight, not 4) and rebuilds each float32 weight with one fma before the same float32 products
(native.qf32_gemv). The weights, and so the arithmetic, are the checkpoint's own.
"""

from __future__ import annotations

import torch
from torch import nn

# rows up to which our GEMV runs (measured against torch's GEMM on the default model's shapes: benchmarks/
# results/NOTES.md "float32 GEMV")
F32_SMALL_M = 16


class F32Linear(nn.Linear):
    """An nn.Linear (float32 weight (N, K) on the CPU, K a multiple of 8) whose calls of at most `small_m` rows
    run our GEMV: over `codes` (exact_codes' (q, d, m) of this very weight) where given, else over the weight.
    The weight and bias are the linear's own Parameters (a tied head stays tied)."""

    def __init__(self, linear: nn.Linear, small_m: int = F32_SMALL_M,
                 codes: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.small_m = small_m
        assert codes is None or codes[0].shape == linear.weight.shape, (codes[0].shape, linear.weight.shape)
        self.codes = codes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from sgnb.kernels import native

        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if x2.shape[0] > self.small_m or x2.dtype != torch.float32 or not x2.is_contiguous():
            return super().forward(x)
        y = native.f32_gemv(x2, self.weight) if self.codes is None else native.qf32_gemv(x2, *self.codes)
        if self.bias is not None:
            y += self.bias
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        read = "its exact int8 codes" if self.codes is not None else "the weight"
        return f"{super().extra_repr()}, our GEMV over {read} <= {self.small_m} rows"


def exact_codes(mode: str, stored: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(q, d, m): int8 codes (N, K) and float32 d, m (N, K / 32), one fma(q, d, m) per weight giving the same
    float32 as the stored form's dequantization (kernels/quant_linear.py stored_dense); None for a form without
    such codes. So for a form that stored_forms found exact, they give the weight itself, bit for bit. q8 ("q8",
    "int8"): m = 0, so the fma rounds q * d once, as the dequantization's product does; our int4 packing: d and m
    are float16s, so q * d (q < 16) is exact in float32 and the fma rounds q * d + m once, as the
    dequantization's add does. (Not checked again here: that check was 90% of this function's time, 1.3 s
    for the default model; tests/kernels/test_native.py holds it.)"""
    from sgnb.kernels import native

    if mode in ("q8", "int8"):
        q = stored["q8"] if mode == "q8" else stored["q"]
        N, K = q.shape
        d = stored["d8"] if mode == "q8" else stored["scale"][:, None].expand(N, K // native.BLOCK)
        m = torch.zeros(N, K // native.BLOCK)
    elif mode == "int4" and "q4" in stored:
        q, d, m = native.q4_codes(stored["q4"]), stored["d4"], stored["m4"]
    else:
        return None
    return q.to(torch.int8).contiguous(), d.float().contiguous(), m.float().contiguous()


def takes(linear: nn.Module) -> bool:
    """Whether `linear` can become an F32Linear: a plain nn.Linear with a contiguous float32 weight on the CPU
    whose in_features is a multiple of 8."""
    w = getattr(linear, "weight", None)
    return (type(linear) is nn.Linear and w is not None and w.device.type == "cpu" and w.dtype == torch.float32
            and w.is_contiguous() and linear.in_features % 8 == 0)


def use_f32_gemv(module: nn.Module, names: tuple[str, ...],
                 forms: dict[str, tuple[str, dict[str, torch.Tensor], bool]] | None = None) -> int:
    """Replace every child nn.Linear of `module` whose attribute name is in `names` and that `takes`, by an
    F32Linear over the same Parameters, in place; returns how many. `forms`: the layers' stored forms by path
    (kernels/quant_linear.py stored_forms), whose exact ones give the layers their codes (exact_codes). Nothing
    where our kernels do not build."""
    from sgnb.kernels import native
    from sgnb.kernels.quant_linear import named_linears

    if not native.available():
        return 0
    targets = [t for t in named_linears(module, names) if takes(t[3])]
    for path, parent, name, child in targets:
        form = (forms or {}).get(path)
        codes = exact_codes(form[0], form[1]) if form is not None and form[2] else None
        setattr(parent, name, F32Linear(child, codes=codes))
    return len(targets)


def may_have_exact_codes(module: nn.Module, names: tuple[str, ...]) -> bool:
    """A cheap look before stored_forms (which quantizes every layer the first time): whether the first of these
    layers' first 64 rows lie on an int4 or a Q8_0 grid, as weights from a 4-bit or 8-bit GGUF do (a float
    checkpoint's do not)."""
    from sgnb.kernels.quant_linear import int4_is_lossless, named_linears, q8_is_lossless

    first = next((child for _, _, _, child in named_linears(module, names) if takes(child)), None)
    if first is None:
        return False
    rows = first.weight.detach()[:64]
    return int4_is_lossless(rows) or q8_is_lossless(rows)
