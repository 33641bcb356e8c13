"""Backends: what runs a program's gen/select calls.

- Runtime: the in-process engine.
- RuntimeEndpoint: SGLang's native HTTP API (`sgnb serve`, an SGLang server or router).
- OpenAI / Anthropic: the official clients (OpenAI also fits any OpenAI-compatible server).
- LiteLLM (many hosted chat APIs through litellm) and Crusoe (its OpenAI-compatible API), as in SGLang;
  VertexAI only says what to use instead.

`import sgnb.backends` is cheap: the HTTP backends (and requests / openai / anthropic) load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from sgnb.backends.base import Backend, BackendError, ChoiceDecision, GenContext
from sgnb.backends.runtime import Runtime

if TYPE_CHECKING:
    from sgnb.backends.anthropic import Anthropic
    from sgnb.backends.crusoe import Crusoe
    from sgnb.backends.endpoint import RuntimeEndpoint
    from sgnb.backends.litellm import LiteLLM
    from sgnb.backends.openai import OpenAI
    from sgnb.backends.vertexai import VertexAI

_LAZY = {
    "RuntimeEndpoint": "sgnb.backends.endpoint",
    "OpenAI": "sgnb.backends.openai",
    "Anthropic": "sgnb.backends.anthropic",
    "LiteLLM": "sgnb.backends.litellm",
    "Crusoe": "sgnb.backends.crusoe",
    "VertexAI": "sgnb.backends.vertexai",
}

__all__ = ["Anthropic", "Backend", "BackendError", "ChoiceDecision", "Crusoe", "GenContext", "LiteLLM", "OpenAI",
           "Runtime", "RuntimeEndpoint", "VertexAI"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'sgnb.backends' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
