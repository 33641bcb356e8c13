"""FP8 checkpoints (HF `quantization_config.quant_method: "fp8"`): their e4m3 weights into Fp8Linear layers.

Such a checkpoint stores a quantized linear as `X.weight` (float8_e4m3fn) plus `X.weight_scale` (per tensor or
per output channel; AutoFP8 / vLLM's form) or `X.weight_scale_inv` (one per 128x128 block when
`weight_block_size` is [128, 128]; DeepSeek-V3 / Qwen3-FP8's form; despite the name a multiplier:
w = q * scale_inv). Layers without a scale (the head, norms, a router, as the checkpoint chose) are ordinary
tensors. A static activation scale (`X.input_scale`) is dropped: activations are scaled per token at run time.

Loading: `split_fp8_checkpoint` takes the quantized weights out of the state dict and leaves their dequantized
values in their place, so the model's ordinary loading (fusing q/k/v and gate/up, stacking a mixture's experts)
runs unchanged; then `adopt_fp8_linears` replaces each linear whose parts were all quantized by an Fp8Linear
holding the stored e4m3 values and scales, stacked as the fused weight is. Experts of an MoE checkpoint keep
the dequantized weights (the fused-MoE kernel takes bf16 experts).
"""

from __future__ import annotations

import torch
from torch import nn

from sgnb.engine.model_config import ModelConfig
from sgnb.engine.models.llama import hf_names
from sgnb.kernels.fp8_linear import FP8, Fp8Linear, dequantize_fp8, scales_to_rows

_SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale")


def split_fp8_checkpoint(state: dict[str, torch.Tensor], config: ModelConfig,
                         dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Pop every quantized weight's scales (and static input scales) from `state`, put the dequantized weight
    (in `dtype`) where the e4m3 one was, and return {HF weight name: (e4m3 q (N, K), row scales (N, 1) or
    (N, cdiv(K, 128)))}. Other tensors stay as stored."""
    block = config.weight_block_size is not None
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name in [n for n in state if n.endswith(_SCALE_SUFFIXES)]:
        base = name.rsplit(".", 1)[0]  # X
        weight = f"{base}.weight"
        q = state.get(weight)
        if q is None or q.dtype != FP8:
            raise ValueError(f"{name} scales {weight}, which is {'missing' if q is None else q.dtype}, not e4m3")
        rows = scales_to_rows(state.pop(name), (q.shape[0], q.shape[1]), block and name.endswith("_inv"))
        out[weight] = (q, rows)
        state[weight] = dequantize_fp8(q, rows).to(dtype)
    for name in [n for n in state if n.endswith(".input_scale")]:
        del state[name]
    unscaled = [n for n, t in state.items() if t.dtype == FP8]
    if unscaled:
        raise ValueError(f"e4m3 tensor {unscaled[0]!r} has no weight_scale / weight_scale_inv")
    return out


def adopt_fp8_linears(model: nn.Module, fp8: dict[str, tuple[torch.Tensor, torch.Tensor]],
                      names: tuple[str, ...]) -> dict[str, int]:
    """Replace each nn.Linear named in `names` whose HF parts are all in `fp8` by an Fp8Linear of them (parts
    stacked along the rows, as the fused weight is); returns the layer counts by kind ({"fp8": n, ...})."""
    counts: dict[str, int] = {}
    for module_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if name not in names or not isinstance(child, nn.Linear):
                continue
            full = f"{module_name}.{name}.weight" if module_name else f"{name}.weight"
            parts = hf_names(full)
            if not all(p in fp8 for p in parts):
                kind = str(child.weight.dtype).removeprefix("torch.")
                counts[kind] = counts.get(kind, 0) + 1
                continue
            q = torch.cat([fp8[p][0] for p in parts]).to(child.weight.device)
            scales = torch.cat([fp8[p][1] for p in parts]).to(child.weight.device)
            assert q.shape == child.weight.shape, (full, q.shape, child.weight.shape)
            setattr(parent, name, Fp8Linear(q, scales, child.bias))
            counts["fp8"] = counts.get("fp8", 0) + 1
    return counts
