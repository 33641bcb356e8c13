"""Anthropic: a program's backend over Anthropic's Messages API (chat models only).

    backend = Anthropic("claude-sonnet-4-5")

The program's system messages become `system=`; user/assistant messages go as they are. A gen inside an
assistant role that already has text continues it (the partial turn is sent as the final assistant message,
which the Messages API treats as a prefill). There are no token logprobs, so `select` is not available.

Images: image() writes IMAGE_MARKER ("<image>") into the text; each message's content is sent as content blocks
split on it: text blocks and image blocks (`{"type": "image", "source": {"type": "base64", "media_type",
"data"}}`, local files read and encoded here; an http(s) URL as a `url` source). The Messages API takes JPEG,
PNG, GIF and WebP (other images are sent as PNG) and no videos: video() fails at its line.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sgnb.backends.base import Backend, BackendError, ChoiceDecision, GenContext
from sgnb.chat_template import PLAIN, ChatTemplate
from sgnb.media import IMAGE_MARKER, Media, data_url, is_url, split_data_url, with_media_parts
from sgnb.sampling import GenParams

_DEFAULT_MAX_TOKENS = 1024
# sampling values the Messages API knows, with its defaults (sent only when they differ: recent SDKs dropped
# them from create()'s signature, so they travel in extra_body)
_SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1}
_UNSUPPORTED = ("regex", "json_schema", "ebnf", "stop_regex", "stop_token_ids", "min_p", "frequency_penalty",
                "presence_penalty", "repetition_penalty", "min_new_tokens")
_NEUTRAL = {"min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
            "min_new_tokens": 0, "stop_token_ids": ()}


class Anthropic(Backend):
    """`Anthropic(model, api_key=None, **client_kwargs)`; client_kwargs go to `anthropic.Anthropic`
    (base_url, timeout, max_retries, ...)."""

    is_chat_model = True
    image_token = IMAGE_MARKER
    fetches_urls = True

    def __init__(self, model: str, api_key: str | None = None, chat_template: ChatTemplate | None = None,
                 **client_kwargs: Any) -> None:
        import anthropic

        self._anthropic = anthropic
        try:
            self.client = anthropic.Anthropic(api_key=api_key, **client_kwargs)
        except anthropic.AnthropicError as e:
            raise BackendError(f"cannot create the Anthropic client: {e}") from e
        self.model = model
        self._template = chat_template or PLAIN
        self.usage = {"calls": 0, "prompt_tokens": 0, "completion_tokens": 0}
        self._lock = threading.Lock()

    def get_model_name(self) -> str:
        return self.model

    def get_chat_template(self) -> ChatTemplate:
        return self._template

    def get_server_info(self) -> dict[str, Any]:
        return {"backend": "Anthropic", "model": self.model, "base_url": str(self.client.base_url),
                "usage": dict(self.usage)}

    @contextmanager
    def _api_errors(self, what: str) -> Iterator[None]:
        try:
            yield
        except self._anthropic.APIStatusError as e:
            raise BackendError(f"{what} failed: HTTP {e.status_code}: {_status_message(e)}") from e
        except self._anthropic.AnthropicError as e:
            raise BackendError(f"{what} failed: {e}") from e

    def _count(self, usage: Any) -> None:
        with self._lock:
            self.usage["calls"] += 1
            if usage is not None:
                self.usage["prompt_tokens"] += usage.input_tokens or 0
                self.usage["completion_tokens"] += usage.output_tokens or 0

    def _request(self, ctx: GenContext, params: GenParams) -> dict[str, Any]:
        """messages.create() arguments: system text apart, the rest as alternating user/assistant turns."""
        if ctx.in_role not in (None, "assistant"):
            raise BackendError(f"a chat model writes assistant turns only, but this gen is inside {ctx.in_role!r}: "
                               "put it inside assistant(...)")
        if params.n not in (None, 1):
            raise BackendError("n > 1 is not supported on the Anthropic backend: fork the program instead")
        for name in _UNSUPPORTED:
            value = getattr(params, name)
            if value is not None and value != _NEUTRAL.get(name):
                raise BackendError(f"{name} is not available on the Anthropic API")
        system = [m["content"] for m in ctx.messages if m["role"] == "system"]
        messages = [{"role": m["role"], "content": m["content"]} for m in ctx.messages if m["role"] != "system"]
        if ctx.images:
            if any(IMAGE_MARKER in s for s in system):
                raise BackendError("the Messages API takes images in user turns, not in the system prompt")
            try:
                messages = with_media_parts(messages, ctx.images, _image_block)
            except ValueError as e:
                raise BackendError(str(e)) from None
        if messages and messages[-1]["role"] == "assistant":
            # an open assistant turn: empty -> the reply is the turn; with text -> a prefill to continue, which
            # the API refuses with trailing whitespace
            content = messages[-1]["content"]
            if isinstance(content, str) and not content.strip():
                messages.pop()
            elif isinstance(content, str):
                messages[-1]["content"] = content.rstrip()
        if not messages:
            raise BackendError("a chat model needs a user message before the gen")
        kw: dict[str, Any] = {"model": self.model, "messages": messages,
                              "max_tokens": params.max_new_tokens or _DEFAULT_MAX_TOKENS}
        if system:
            kw["system"] = "\n\n".join(system)
        if params.stop:
            kw["stop_sequences"] = list(params.stop)
        extra = {k: getattr(params, k) for k, default in _SAMPLING.items()
                 if getattr(params, k) is not None and getattr(params, k) != default}
        if extra.get("top_k", 1) <= 0:
            extra.pop("top_k", None)
        if extra:
            kw["extra_body"] = extra
        return kw

    def generate(self, ctx: GenContext, params: GenParams) -> tuple[str, dict[str, Any]]:
        kw = self._request(ctx, params)
        with self._api_errors("Anthropic messages.create"):
            msg = self.client.messages.create(**kw)
        self._count(msg.usage)
        return _text(msg), _meta(msg)

    def generate_stream(self, ctx: GenContext, params: GenParams) -> Iterator[tuple[str, dict[str, Any]]]:
        kw = self._request(ctx, params)
        with self._api_errors("Anthropic messages.stream"):
            with self.client.messages.stream(**kw) as stream:
                for piece in stream.text_stream:
                    if piece:
                        yield piece, {}
                msg = stream.get_final_message()
        self._count(msg.usage)
        yield "", _meta(msg)

    def select(self, ctx: GenContext, choices: list[str], temperature: float,
               choices_method: str) -> ChoiceDecision:
        raise BackendError("select needs token logprobs of given text, which the Anthropic API does not return; "
                           "use gen with a regex on a local or SGLang backend, or a completion model")


def _image_block(media: Media) -> dict[str, Any]:
    if is_url(media.data):
        return {"type": "image", "source": {"type": "url", "url": str(media.data).strip()}}
    media_type, payload = split_data_url(data_url(media))
    return {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": payload}}


def _text(msg: Any) -> str:
    return "".join(block.text for block in msg.content if getattr(block, "type", None) == "text")


def _meta(msg: Any) -> dict[str, Any]:
    reason = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length"}.get(msg.stop_reason,
                                                                                        msg.stop_reason)
    finish: dict[str, Any] = {"type": reason}
    if msg.stop_sequence is not None:
        finish["matched"] = msg.stop_sequence
    meta: dict[str, Any] = {"id": msg.id, "finish_reason": finish, "stop_reason": msg.stop_reason}
    if msg.usage is not None:
        meta.update(prompt_tokens=msg.usage.input_tokens, completion_tokens=msg.usage.output_tokens)
    return meta


def _status_message(e: Any) -> str:
    body = getattr(e, "body", None)
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
    return str(getattr(e, "message", e))
