"""sglang.lang.backend.litellm: sgnb's LiteLLM."""

from sgnb.backends.litellm import LiteLLM

__all__ = ["LiteLLM"]
