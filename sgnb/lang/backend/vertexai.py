"""sglang.lang.backend.vertexai: sgnb's VertexAI."""

from sgnb.backends.vertexai import VertexAI

__all__ = ["VertexAI"]
