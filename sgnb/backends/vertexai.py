"""VertexAI: SGLang's Vertex AI backend (`sgl.VertexAI`) has no sgnb implementation of its own; the name is here
so that a program using it fails at once, saying what to use instead."""

from __future__ import annotations

from typing import Any

from sgnb.backends.base import Backend


class VertexAI(Backend):
    """Raises NotImplementedError: use `sgl.LiteLLM("vertex_ai/<model>")` (LiteLLM speaks to Vertex AI with the
    environment's GCP credentials), or `sgl.OpenAI` on Vertex AI's OpenAI-compatible endpoint."""

    def __init__(self, model_name: str = "<model>", *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            f"sgnb has no Vertex AI backend of its own: use sgl.LiteLLM('vertex_ai/{model_name}') (LiteLLM reads "
            "the GCP project and credentials from the environment; needs the litellm package), or sgl.OpenAI(...) "
            "with Vertex AI's OpenAI-compatible endpoint as base_url")
