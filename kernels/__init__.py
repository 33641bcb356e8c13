"""sgnb.kernels: compute kernels, each beside a pure-torch reference (the CPU path and the test oracle).

Kernels are leaves: they import torch (and triton when installed), nothing of sgnb. Each public name below is a
dispatcher: the Triton kernel for CUDA tensors, else the torch reference (tests reach the Triton kernels on CPU
through TRITON_INTERPRET=1 and each module's `_*_triton` wrapper). They are loaded lazily, so `import sgnb.kernels` imports neither torch nor triton.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

if __name__ == "kernels":  # (tests/test_package.py runs this in a subprocess)
    # This folder was imported as a top-level `kernels`: a checkout's root is on sys.path (`python -m`, `python -c`
    # or a kernel started there) and shadows Hugging Face's `kernels` package, which transformers imports when it is
    # installed. Load that package in this module's place; with none installed, `import kernels` fails as usual.
    import importlib.machinery
    import importlib.util

    _here = Path(__file__).resolve().parent.parent
    _path = [p for p in sys.path if Path(p or ".").resolve() != _here]
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _path)
    if _spec is None or _spec.loader is None:
        raise ModuleNotFoundError("No module named 'kernels' (this checkout's kernels/ folder is sgnb.kernels)",
                                  name="kernels")
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["kernels"] = _module  # the import statement returns what sys.modules holds once this file ends
    _spec.loader.exec_module(_module)

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
