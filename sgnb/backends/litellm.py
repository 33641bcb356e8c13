"""LiteLLM: a program's backend through LiteLLM's `completion()`, one OpenAI-shaped call for many hosted chat APIs
(SGLang's `sgl.LiteLLM`). Needs the litellm package (`pip install litellm`; DSPy brings it).

    backend = LiteLLM("anthropic/claude-sonnet-4-5")       # the model as LiteLLM names it; keys from the environment
    backend = LiteLLM("vertex_ai/gemini-2.0-flash")         # Vertex AI, with the environment's GCP credentials
    backend = LiteLLM("openai/smollm2", base_url="http://localhost:30000/v1", api_key="x")  # any OpenAI-style server

Chat models only. This is the OpenAI backend's chat path (messages, images as content parts, json_schema as
response_format, usage counts, streaming) with its calls made by `litellm.completion`, whose errors are the openai
package's exception types (so they surface as BackendError, the same way). What OpenAI's API lacks is handled as on
OpenAI: SGLang's extra sampling values (top_k, min_p, ...) are ignored with a warning, constrained decoding (regex,
ebnf, stop_regex) is refused, and `select` is not available (no prompt logprobs). As in SGLang, a program that
wrote no roles sends its whole text as one user message.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

from sgnb.backends.base import GenContext
from sgnb.backends.openai import OpenAI
from sgnb.chat_template import ChatTemplate


class LiteLLM(OpenAI):
    """`LiteLLM(model_name, chat_template=None, api_key=None, organization=None, base_url=None, timeout=600,
    max_retries=None, default_headers=None, **completion_kwargs)`: SGLang's arguments; completion_kwargs go to
    every `litellm.completion` call as they are (e.g. `vertex_project=...`)."""

    api_name = "LiteLLM"

    def __init__(self, model_name: str, chat_template: ChatTemplate | str | None = None, api_key: str | None = None,
                 organization: str | None = None, base_url: str | None = None, timeout: float | None = 600,
                 max_retries: int | None = None, default_headers: Mapping[str, str] | None = None,
                 **completion_kwargs: Any) -> None:
        try:
            import litellm
        except ImportError:
            raise ImportError("sgnb.LiteLLM needs the litellm package: pip install litellm") from None
        self._litellm = litellm
        options = {"organization": organization, "timeout": timeout, "max_retries": max_retries,
                   "extra_headers": dict(default_headers) if default_headers else None, **completion_kwargs}
        super().__init__(model_name, base_url=base_url, api_key=api_key, is_chat_model=True,
                         chat_template=chat_template, **{k: v for k, v in options.items() if v is not None})
        self.is_openai = True  # a hosted API: OpenAI's parameters only (LiteLLM translates those)

    def _make_client(self, api_key: str | None, client_kwargs: dict[str, Any]) -> Any:
        params = {"api_key": api_key, **client_kwargs}
        return _LiteLLMClient(self._litellm, {k: v for k, v in params.items() if v is not None})

    def _max_tokens_arg(self) -> str:
        return "max_tokens"  # the name every provider LiteLLM speaks to takes

    def _chat_messages(self, ctx: GenContext) -> list[dict[str, Any]]:
        if not ctx.messages and ctx.in_role is None and ctx.text:
            ctx = GenContext(ctx.text, [{"role": "user", "content": ctx.text}], ctx.rid, ctx.images, ctx.program,
                             ctx.num_api_spec_tokens, ctx.in_role)
        return super()._chat_messages(ctx)


class _LiteLLMClient:
    """The part of openai.OpenAI the OpenAI backend calls (chat completions), made by litellm.completion with
    this backend's connection options."""

    def __init__(self, litellm: Any, options: dict[str, Any]) -> None:
        self.base_url = options.get("base_url") or "litellm"
        self.chat = SimpleNamespace(completions=SimpleNamespace(
            create=lambda **kwargs: litellm.completion(**options, **kwargs)))
