"""What the Triton kernels share: whether triton imports, and whether its interpreter was on at import.

The one place that reads TRITON_INTERPRET. Triton decides at decoration time (`@triton.jit`) whether a kernel is
compiled or interpreted, so the flag is read once, when this module is imported, and kernel modules import it
before decorating anything. Every kernel module must import without triton: `jit` is then a no-op decorator and
`tl` is None, which is fine because the kernels' annotations stay strings (`from __future__ import annotations`)
and their bodies never run (`use_triton` is False).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # CPU installs without triton: only the torch references run
    triton = None
    tl = None
    HAS_TRITON = False

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def jit(fn: Callable[..., Any] | None = None, **options: Any) -> Any:
    """`triton.jit`, as `@jit` or `@jit(do_not_specialize=[...])`; without triton a no-op (never launched:
    use_triton() is False then)."""
    if fn is None:
        return lambda f: jit(f, **options)
    if not HAS_TRITON:
        return fn
    kernel = triton.jit(fn, **options)
    KERNELS.append(kernel)
    return kernel


KERNELS: list[Any] = []  # every kernel made by `jit` (compiled_variants counts their compiles)


def compiled_variants() -> dict[str, int]:
    """Compiled variants of each of our Triton kernels that has any, by name, over all devices (Triton compiles
    one per constexpr combination and per argument specialization: an int's divisibility by 16, a pointer's
    16-byte alignment). A count that grows while a workload runs means a compile inside its timing."""
    out: dict[str, int] = {}
    for k in KERNELS:
        caches = getattr(k, "device_caches", None) or {}
        n = sum(len(c[0]) for c in caches.values() if isinstance(c, tuple) and c and isinstance(c[0], dict))
        if n:
            name = str(getattr(k, "__name__", None) or getattr(getattr(k, "fn", None), "__name__", "?"))
            out[name] = out.get(name, 0) + n
    return out


def constexpr(x: float) -> Any:
    """A module constant that kernels may read (Triton lets kernels read only constexpr globals)."""
    return tl.constexpr(x) if HAS_TRITON else x


def use_triton(t: torch.Tensor) -> bool:
    """Whether a dispatcher runs the Triton kernel for tensor t: only on a GPU. CPU tensors take the torch
    reference even under TRITON_INTERPRET=1 (the interpreter is for testing the kernels, which tests call
    through their `_*_triton` wrappers, not for running the CPU engine ~100x slower)."""
    return HAS_TRITON and t.is_cuda


def next_pow2(n: int) -> int:
    """Smallest power of 2 >= n (>= 1): tl.arange needs power-of-2 lengths."""
    return 1 << max(n - 1, 0).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)

