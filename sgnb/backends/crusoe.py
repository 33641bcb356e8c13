"""Crusoe: Crusoe Cloud's managed inference, an OpenAI-compatible API (SGLang's `sgl.Crusoe`).

    backend = Crusoe("meta-llama/Llama-3.3-70B-Instruct")   # the key from CRUSOE_API_KEY

The OpenAI backend with Crusoe's endpoint and key as defaults; everything else is as there (an OpenAI-compatible
server: SGLang's extra sampling values go in extra_body, and the server decides what it takes).
"""

from __future__ import annotations

import os
from typing import Any

from sgnb.backends.openai import OpenAI
from sgnb.chat_template import ChatTemplate

CRUSOE_BASE_URL = "https://managed-inference-api-proxy.crusoecloud.com/v1/"


class Crusoe(OpenAI):
    """`Crusoe(model_name, api_key=None, base_url=None, chat_template=None, **kwargs)`: api_key defaults to
    $CRUSOE_API_KEY (ValueError when neither is set), base_url to CRUSOE_BASE_URL, is_chat_model to True (its
    models are served as chat models, "-Instruct" names included); kwargs as OpenAI's."""

    api_name = "Crusoe"

    def __init__(self, model_name: str, api_key: str | None = None, base_url: str | None = None,
                 chat_template: ChatTemplate | str | None = None, **kwargs: Any) -> None:
        key = api_key or os.environ.get("CRUSOE_API_KEY")
        if not key:
            raise ValueError("Crusoe needs an API key: pass api_key=... or set CRUSOE_API_KEY")
        kwargs.setdefault("is_chat_model", True)
        super().__init__(model_name, base_url=base_url or CRUSOE_BASE_URL, api_key=key, chat_template=chat_template,
                         **kwargs)
