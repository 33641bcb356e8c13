"""float32 linear layers on the CPU (the exact engine: `quantization="none"`): our GEMV (kernels/native.py
f32_gemv) for decode-sized batches of rows, torch's GEMM above, on the one weight tensor.

torch's float32 GEMM at a few rows runs far below both of a CPU's limits: on the 2-core AVX2 EPYC the default
model's layers at 6 rows took 2.1x their time at one row (15 GFLOP/s), though a step reads the same weights
at any row count. Our kernel reads each weight once per call and computes every row alike, so a row's result
does not depend on the rows beside it (a request's logits do not change with its batch) up to `small_m`
rows; above, a GEMM's compute per weight wins and torch's runs. The decode forward in one call
(native.decode_layers) takes these layers too (native.linear_fields).
"""

from __future__ import annotations

import torch
from torch import nn

# rows up to which our GEMV runs (measured against torch's GEMM on the default model's shapes: benchmarks/
# results/NOTES.md "float32 GEMV")
F32_SMALL_M = 16


class F32Linear(nn.Linear):
    """An nn.Linear (float32 weight (N, K) on the CPU, K a multiple of 8) whose calls of at most `small_m` rows
    run our GEMV. The weight and bias are the linear's own Parameters (a tied head stays tied)."""

    def __init__(self, linear: nn.Linear, small_m: int = F32_SMALL_M) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.small_m = small_m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from sgnb.kernels import native

        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if x2.shape[0] > self.small_m or x2.dtype != torch.float32 or not x2.is_contiguous():
            return super().forward(x)
        y = native.f32_gemv(x2, self.weight)
        if self.bias is not None:
            y += self.bias
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, our GEMV <= {self.small_m} rows"


def takes(linear: nn.Module) -> bool:
    """Whether `linear` can become an F32Linear: a plain nn.Linear with a contiguous float32 weight on the CPU
    whose in_features is a multiple of 8."""
    w = getattr(linear, "weight", None)
    return (type(linear) is nn.Linear and w is not None and w.device.type == "cpu" and w.dtype == torch.float32
            and w.is_contiguous() and linear.in_features % 8 == 0)


def use_f32_gemv(module: nn.Module, names: tuple[str, ...]) -> int:
    """Replace every child nn.Linear of `module` whose attribute name is in `names` and that `takes`, by an
    F32Linear over the same Parameters, in place; returns how many. Nothing where our kernels do not build."""
    from sgnb.kernels import native

    if not native.available():
        return 0
    targets = [(parent, name, child) for parent in module.modules() for name, child in parent.named_children()
               if name in names and isinstance(child, nn.Linear) and takes(child)]
    for parent, name, child in targets:
        setattr(parent, name, F32Linear(child))
    return len(targets)
