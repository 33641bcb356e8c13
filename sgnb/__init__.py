"""sgnb: write and run LM programs in Jupyter, on an in-kernel RadixAttention engine.

SGLang-compatible: `import sgnb as sgl` and an SGLang frontend program runs unchanged. `import sgnb` is cheap:
torch and the engine load on first use of `sgnb.Engine` / `sgnb.Runtime`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sgnb.backends.base import Backend, BackendError
from sgnb.function import SglFunction, function, get_default_backend, global_config, set_default_backend
from sgnb.interpreter import ProgramError
from sgnb.primitives import (
    REGEX_BOOL,
    REGEX_FLOAT,
    REGEX_INT,
    REGEX_STR,
    assistant,
    assistant_begin,
    assistant_end,
    gen,
    gen_int,
    gen_string,
    greedy_token_selection,
    image,
    select,
    separate_reasoning,
    system,
    system_begin,
    system_end,
    token_length_normalized,
    tool,
    unconditional_likelihood_normalized,
    user,
    user_begin,
    user_end,
    video,
)
from sgnb.state import ProgramState, ProgramStateGroup

__version__ = "0.1.0"

if TYPE_CHECKING:
    from sgnb.backends.anthropic import Anthropic
    from sgnb.backends.crusoe import Crusoe
    from sgnb.backends.endpoint import RuntimeEndpoint
    from sgnb.backends.litellm import LiteLLM
    from sgnb.backends.openai import OpenAI
    from sgnb.backends.runtime import Runtime
    from sgnb.backends.vertexai import VertexAI
    from sgnb.engine import Engine, EngineConfig, SamplingParams

_LAZY = {
    "Engine": "sgnb.engine",
    "EngineConfig": "sgnb.engine",
    "SamplingParams": "sgnb.engine",
    "Runtime": "sgnb.backends.runtime",
    "RuntimeEndpoint": "sgnb.backends.endpoint",
    "OpenAI": "sgnb.backends.openai",
    "Anthropic": "sgnb.backends.anthropic",
    "LiteLLM": "sgnb.backends.litellm",
    "Crusoe": "sgnb.backends.crusoe",
    "VertexAI": "sgnb.backends.vertexai",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'sgnb' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


class ServerArgs:
    """SGLang's server configuration (`sgl.ServerArgs`). sgnb has none by that name: constructing one raises
    NotImplementedError saying what configures what here."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            "sgnb has no ServerArgs: the in-process engine takes its options as keywords, "
            "sgl.Runtime(model_path, **options) or sgl.Engine(model_path, **options) (sgl.EngineConfig lists them), "
            "and the server is started with `sgnb serve --model ...` (`sgnb serve --help` lists its flags)")


def load_ipython_extension(ip: Any) -> None:
    """`%load_ext sgnb`: register the `%sgl` and `%%sgl` magics (see sgnb.kernel_ext)."""
    from sgnb.kernel_ext import load_ipython_extension as load

    load(ip)


def unload_ipython_extension(ip: Any) -> None:
    from sgnb.kernel_ext import unload_ipython_extension as unload

    unload(ip)


def load_notebook(path: str, name: str | None = None) -> Any:
    """Import a notebook's definitions (`@function` programs, imports, constants) as a module without running
    its programs; see sgnb.notebook_import.load_notebook for exactly which statements run."""
    from sgnb.notebook_import import load_notebook as load

    return load(path, name)


def flush_cache(backend: Backend | None = None) -> bool | None:
    """Empty the backend's prefix cache. As SGLang's: None once asked, False when there is no backend; a cache
    the backend could not flush (requests in flight, an API backend) is said in a warning (`backend.flush_cache()`
    itself returns whether it was flushed)."""
    b = backend or get_default_backend()
    if b is None:
        return False
    if not b.flush_cache():
        import warnings

        warnings.warn(f"sgnb: {type(b).__name__} did not flush its cache (requests in flight, or it has none)",
                      stacklevel=2)
    return None


def get_server_info(backend: Backend | None = None) -> dict:
    b = backend or get_default_backend()
    if b is None:
        raise RuntimeError("no backend: call sgnb.set_default_backend(...) first")
    return b.get_server_info()


__all__ = [
    "REGEX_BOOL", "REGEX_FLOAT", "REGEX_INT", "REGEX_STR", "global_config", "greedy_token_selection",
    "token_length_normalized", "unconditional_likelihood_normalized",
    "Anthropic", "Backend", "BackendError", "Crusoe", "Engine", "EngineConfig", "LiteLLM", "OpenAI", "ProgramError",
    "ProgramState", "ProgramStateGroup", "Runtime", "RuntimeEndpoint", "SamplingParams", "ServerArgs",
    "SglFunction", "VertexAI", "assistant",
    "assistant_begin", "assistant_end", "flush_cache", "function", "gen", "gen_int", "gen_string",
    "get_default_backend", "get_server_info", "image", "load_notebook", "select", "separate_reasoning",
    "set_default_backend", "system", "system_begin", "system_end", "tool", "user", "user_begin", "user_end", "video",
    "__version__",
]
