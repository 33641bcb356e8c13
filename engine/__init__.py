"""sgnb.engine: the in-process runtime (radix cache, KV pool, scheduler, model runner, models).

The engine knows no programs, no screen and no IPython: it runs the same in a script, a server or a kernel.
"""

from __future__ import annotations

from sgnb.engine.config import EngineConfig
from sgnb.engine.sampling_params import SamplingParams

__all__ = ["Engine", "EngineConfig", "SamplingParams"]


def __getattr__(name: str):  # torch is imported only when the Engine itself is used
    if name == "Engine":
        from sgnb.engine.engine import Engine

        return Engine
    raise AttributeError(f"module 'sgnb.engine' has no attribute {name!r}")
