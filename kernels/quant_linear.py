"""Weight-quantized linear layers for the CPU engine: int8 (per output channel) or int4 (groups of 32) weights with
bf16 activations at the matmul boundary, and a bf16 copy of the weights for large batches of rows.

"q8" (int8 in blocks of 32 along K, Q8_0's layout) runs on our own kernel (kernels/native.py, an AVX2 integer
GEMV with the rows rounded to int8 per block as llama.cpp does): it is the head's mode when the head came from a
Q8_0 GGUF tensor (the default model's tied embedding), where it holds the weights exactly and reads half of a
bf16 head's bytes (~2x faster at decode sizes).

Why both: on a CPU a decode step is bound by the bytes of weights it reads (fp32 SmolLM2-135M: 540 MB per step),
and torch's weight-only kernels (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`) read 4x / 8x fewer bytes,
but they are vectorized only for bf16 activations and lose to a plain bf16 GEMM once many rows share the weights
(prefill). So a layer keeps the packed weights for calls of at most `small_m` rows and a bf16 weight for larger
ones (the dequantized quantized weights, so both paths compute with the same weights); activations stay fp32
outside the layer. Measured on the 2-core AVX2 EPYC (30 layers of SmolLM2 linears,
weights streamed from DRAM): M=1 fp32 25.5 ms, bf16 11.6, int8 4.3, int4 2.8; M=16: 41 / 16 / 14.5 / 11.4;
M=64: 101 / 33 / 47 / 41 (benchmarks/results/NOTES.md).

The torch reference (`quant_linear_ref`) dequantizes explicitly; the layer must equal it.
"""

from __future__ import annotations

import torch
from torch import nn

INT4_GROUP = 32
SMALL_M = 8  # rows up to which the packed weights beat the bf16 GEMM (measured crossover ~8-16)
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


def quant_linear_ref(x: torch.Tensor, mode: str, packed: dict[str, torch.Tensor],
                     bias: torch.Tensor | None) -> torch.Tensor:
    """What QuantLinear computes for a small batch: bf16 activations times the dequantized weight, fp32 out."""
    y = x.to(torch.bfloat16).float() @ dequantize(mode, packed).t()
    return y if bias is None else y + bias.float()


class QuantLinear(nn.Module):
    """A drop-in for nn.Linear (weights (N, K)): packed int8/int4 weights for <= small_m rows, a bf16 copy above.
    Input and output keep the caller's dtype (fp32 on CPU)."""

    def __init__(self, linear: nn.Linear, mode: str, small_m: int = SMALL_M) -> None:
        super().__init__()
        assert mode in MODES, mode
        w = linear.weight.detach()
        self.mode, self.small_m = mode, small_m
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float(), requires_grad=False)
        if mode == "bf16":  # bf16 weights at every size (half the bytes of fp32, no quantization grid)
            self.small_m = 0
            self.weight_bf16 = w.to(torch.bfloat16).contiguous()
            return
        if mode == "q8":
            from sgnb.kernels import native

            self._q8, self._d8 = native.quantize_q8(w)
            self.weight_bf16 = native.dequantize_q8(self._q8, self._d8).to(torch.bfloat16).contiguous()
            self._gemv = native.q8_gemv
            return
        if mode == "int8":
            q, scale = quantize_int8(w)
            packed = {"q": q, "scale": scale}
            self._w8, self._s8 = q, scale.to(torch.bfloat16)
        else:
            q, scale, zero = quantize_int4(w)
            packed = {"q": q, "scale": scale, "zero": zero}
            self._w4 = torch._convert_weight_to_int4pack_for_cpu(q, 1)
            self._sz4 = torch.stack([scale.t(), zero.t()], dim=-1).contiguous().to(torch.bfloat16)  # (G, N, 2)
        # the large-batch path multiplies by the SAME quantized weights (dequantized, in bf16): a request's
        # logits then differ between batch sizes by rounding only, not by quantization error
        self.weight_bf16 = dequantize(mode, packed).to(torch.bfloat16).contiguous()  # (N, K)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # (M, K)
        if x2.shape[0] > self.small_m:
            y = nn.functional.linear(x2.to(torch.bfloat16), self.weight_bf16)
        elif self.mode == "q8":
            y = self._gemv(x2.float().contiguous(), self._q8, self._d8)
        elif self.mode == "int8":
            y = torch._weight_int8pack_mm(x2.to(torch.bfloat16), self._w8, self._s8)
        else:
            y = torch._weight_int4pack_mm_for_cpu(x2.to(torch.bfloat16), self._w4, INT4_GROUP, self._sz4)
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, {self.mode} <= {self.small_m} rows, bf16 above"


def int4_is_lossless(w: torch.Tensor) -> bool:
    """Whether int4 groups reproduce `w` (relative error < LOSSLESS_INT4): true of weights that came from a
    4-bit GGUF (Q4_0 / Q4_1 dequantized), such as the default model's linears."""
    if w.shape[1] % INT4_GROUP:
        return False
    q, scale, zero = quantize_int4(w)
    back = dequantize("int4", {"q": q, "scale": scale, "zero": zero})
    return bool((back - w.float()).norm() <= LOSSLESS_INT4 * w.float().norm())


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
    if requested == "auto":
        if int4_is_lossless(w):
            return "int4"
        if head:
            from sgnb.kernels import native

            return "q8" if native.available() and q8_is_lossless(w) else "bf16"
        return "int8"
    if requested == "int4" and w.shape[1] % INT4_GROUP:
        return "int8"
    return requested


def quantize_linears(module: nn.Module, mode: str, names: tuple[str, ...], head: str = "lm_head",
                     small_m: int = SMALL_M) -> dict[str, int]:
    """Replace every nn.Linear child whose attribute name is in `names` by a QuantLinear, in place, with
    `mode` ("int8" | "int4" | "q8" | "bf16" | "auto": see choose_mode; the head (`head`) takes "auto"'s choice
    whatever the mode: int4 or q8 where lossless, else bf16); returns how many layers took each mode. A tied weight (lm_head =
    embedding) stays the embedding's: the head gets its own copy."""
    counts: dict[str, int] = {}
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if name in names and isinstance(child, nn.Linear):
                w = child.weight.detach()
                chosen = choose_mode(w, "auto" if name == head else mode, head=name == head)
                setattr(parent, name, QuantLinear(child, chosen, small_m))
                counts[chosen] = counts.get(chosen, 0) + 1
    return counts
