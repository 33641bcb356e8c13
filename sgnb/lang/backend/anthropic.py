"""sglang.lang.backend.anthropic: sgnb's Anthropic."""

from sgnb.backends.anthropic import Anthropic

__all__ = ["Anthropic"]
