"""Test weights on a quantization grid, shared by the kernel tests."""

from __future__ import annotations

import torch


def q4_0_weight(n: int, k: int, seed: int, d_span: float = 0.02) -> torch.Tensor:
    """An (n, k) float32 weight as a Q4_0 GGUF tensor dequantizes: d * (q - 8) per block of 32, d a float16 in
    [0.001, 0.001 + d_span), each block using codes 0 and 15 (so its int4 form is exactly that grid)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g)
    q[..., 0], q[..., 1] = 0, 15
    d = (torch.rand(n, k // 32, 1, generator=g) * d_span + 0.001).half().float()
    return ((q - 8).float() * d).view(n, k)
