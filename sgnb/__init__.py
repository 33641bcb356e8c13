"""sgnb: write and run LM programs in Jupyter, on an in-kernel RadixAttention engine.

`import sgnb` is cheap: torch and the engine load on first use of `sgnb.Engine`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from sgnb.engine import Engine, EngineConfig, SamplingParams

_LAZY = {
    "Engine": "sgnb.engine",
    "EngineConfig": "sgnb.engine",
    "SamplingParams": "sgnb.engine",
}

__all__ = ["Engine", "EngineConfig", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'sgnb' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
