"""sgnb.kernels: compute kernels, each beside a pure-torch reference (the CPU path and the test oracle).

Kernels are leaves: they import torch (and triton when installed), nothing of sgnb. Each public name below is a
dispatcher: the Triton kernel for CUDA tensors, else the torch reference (tests reach the Triton kernels on CPU
through TRITON_INTERPRET=1 and each module's `_*_triton` wrapper). They are loaded lazily, so `import sgnb.kernels` imports neither torch nor triton.
"""

from __future__ import annotations

import importlib
from typing import Any

# public name -> submodule that defines it
_LAZY = {
    "rms_norm": "norm",
    "fused_add_rms_norm": "norm",
    "apply_rope": "rope",
    "silu_and_mul": "activation",
    "store_kv": "kv_store",
    "apply_token_bitmask": "bitmask",
}
# The attention kernels share their modules' names (sgnb.kernels.decode_attention is the module once imported):
# import them from their modules, e.g. `from sgnb.kernels.decode_attention import decode_attention`.

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
