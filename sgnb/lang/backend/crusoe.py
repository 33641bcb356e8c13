"""sglang.lang.backend.crusoe: sgnb's Crusoe."""

from sgnb.backends.crusoe import Crusoe

__all__ = ["Crusoe"]
