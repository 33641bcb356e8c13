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

from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any

from sgnb.backends._api_common import Usage, api_errors, check_assistant_turn, check_one_sample, token_counts
from sgnb.backends.base import Backend, BackendError, ChoiceDecision, GenContext
from sgnb.chat_template import PLAIN, ChatTemplate
from sgnb.engine.meta_info import FinishReason, MetaInfo
from sgnb.media import IMAGE_MARKER, Media, data_url, is_url, split_data_url, with_media_parts
from sgnb.sampling import SAMPLING_DEFAULTS, SAMPLING_FIELDS, GenParams

_DEFAULT_MAX_TOKENS = 1024
# sampling values the Messages API knows besides max_tokens and stop (sent only when they differ from the
# engine's defaults, which are the API's too: recent SDKs dropped them from create()'s signature, so they travel
# in extra_body)
_SAMPLING = ("temperature", "top_p", "top_k")
# the others are refused unless at their defaults (ignore_eos: not refused, and not honoured)
_UNSUPPORTED = tuple(name for name in SAMPLING_FIELDS
                     if name not in (*_SAMPLING, "max_new_tokens", "stop", "n", "ignore_eos"))


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
        self.usage = Usage()

    def get_model_name(self) -> str:
        return self.model

    def get_chat_template(self) -> ChatTemplate:
        return self._template

    def get_server_info(self) -> dict[str, Any]:
        return {"backend": "Anthropic", "model": self.model, "base_url": str(self.client.base_url),
                "usage": dict(self.usage)}

    def _api_errors(self, what: str) -> AbstractContextManager[None]:
        return api_errors(what, self._anthropic.APIStatusError, self._anthropic.AnthropicError)

    def _count(self, usage: Any) -> None:
        self.usage.add({"calls": 1, **token_counts(usage, "input_tokens", "output_tokens")})

    def _request(self, ctx: GenContext, params: GenParams) -> dict[str, Any]:
        """messages.create() arguments: system text apart, the rest as alternating user/assistant turns."""
        check_assistant_turn(ctx)
        check_one_sample(params, "Anthropic")
        for name in _UNSUPPORTED:
            value = getattr(params, name)
            if value is not None and value != SAMPLING_DEFAULTS[name]:
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
        extra = {k: getattr(params, k) for k in _SAMPLING
                 if getattr(params, k) is not None and getattr(params, k) != SAMPLING_DEFAULTS[k]}
        if extra.get("top_k", 1) <= 0:
            extra.pop("top_k", None)
        if extra:
            kw["extra_body"] = extra
        return kw

    def generate(self, ctx: GenContext, params: GenParams) -> tuple[str, MetaInfo]:
        kw = self._request(ctx, params)
        with self._api_errors("Anthropic messages.create"):
            msg = self.client.messages.create(**kw)
        self._count(msg.usage)
        return _text(msg), _meta(msg)

    def generate_stream(self, ctx: GenContext, params: GenParams) -> Iterator[tuple[str, MetaInfo]]:
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


def _meta(msg: Any) -> MetaInfo:
    reason = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length"}.get(msg.stop_reason,
                                                                                        msg.stop_reason)
    finish: FinishReason = {"type": reason}
    if msg.stop_sequence is not None:
        finish["matched"] = msg.stop_sequence
    meta: MetaInfo = {"id": msg.id, "finish_reason": finish, "stop_reason": msg.stop_reason}
    if msg.usage is not None:
        meta.update({"prompt_tokens": msg.usage.input_tokens, "completion_tokens": msg.usage.output_tokens})
    return meta
