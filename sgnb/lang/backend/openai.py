"""sglang.lang.backend.openai: sgnb's OpenAI."""

from sgnb.backends.openai import OpenAI

__all__ = ["OpenAI"]
