"""The backend protocol: what the interpreter needs from whatever runs the model.

A backend gets the program's text so far (and its chat messages) and returns generated text. Backends are
called from the programs' executor threads, concurrently: implementations must be thread-safe.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sgnb.chat_template import PLAIN, ChatTemplate
from sgnb.engine.meta_info import MetaInfo
from sgnb.media import Media, is_url
from sgnb.sampling import GenParams

if TYPE_CHECKING:
    from sgnb.tools import ToolPlan


@dataclass
class GenContext:
    """What one gen/select sees: the program's text and messages, and a request id for aborts."""

    text: str
    messages: list[dict[str, Any]]
    rid: str
    # the program's images and videos in order; `text` (and the messages) hold the backend's image (video) token
    # where each one is
    images: list[Media] = field(default_factory=list)
    # per-program scratch space for backends (e.g. speculative API execution keeps its lookahead here)
    program: dict[str, Any] = field(default_factory=dict)
    num_api_spec_tokens: int | None = None
    in_role: str | None = None  # the role whose content is being written, if any
    # a streamed gen's pieces come at most this often (the steps between travel together); None: the backend's
    # own pace. A view that refreshes at 4 Hz asks for 0.25 s: its programs' threads then wake no more often
    stream_interval_s: float | None = None


@dataclass(frozen=True)
class ChoiceDecision:
    decision: str
    meta_info: MetaInfo  # a select's (its choices' scores)


class BackendError(RuntimeError):
    """The backend could not serve a request (a server error, an aborted request, an unsupported feature)."""


class RequestAborted(BackendError):
    """The request was aborted before it finished (an interrupted cell, a client that went away). `text` is what
    it generated that the caller has not been given yet (the whole output for a plain generate, the last piece
    for a stream) and `meta` its meta_info (finish_reason "abort", the token counts so far)."""

    def __init__(self, message: str, text: str = "", meta: MetaInfo | None = None) -> None:
        super().__init__(message)
        self.text = text
        self.meta: MetaInfo = {**(meta or {})}


class Backend:
    """Base class. Subclasses implement generate and select; the rest have sensible defaults."""

    is_chat_model: bool = False
    # the text that stands for an image (a video) in this backend's prompts; None: it takes none
    image_token: str | None = None
    video_token: str | None = None
    fetches_urls: bool = False  # whether an http(s) image URL can be given (the far side fetches it)

    def get_model_name(self) -> str:
        raise NotImplementedError

    def get_chat_template(self) -> ChatTemplate:
        return PLAIN

    def media_token(self, media: Media) -> str:
        """The token text an image()/video() appends; raises BackendError (at the program's image()/video()
        line) when this backend cannot take `media`."""
        token = self.image_token if media.kind == "image" else self.video_token
        if token is None:
            hint = "a LLaVA-family checkpoint" if media.kind == "image" else "a LLaVA-NeXT-Video checkpoint"
            raise BackendError(f"{self.get_model_name()} ({type(self).__name__} backend) takes no {media.kind}s: "
                               f"use a model that does ({hint})")
        if is_url(media.data) and not self.fetches_urls:
            raise BackendError(f"{type(self).__name__} does not fetch URLs ({str(media.data)[:80]!r}): download "
                               f"the {media.kind} and pass its path")
        return token

    def cache_prefix(self, prefix: str, images: list[Media] | None = None) -> None:
        """Frontend hint: `prefix` (with `images`, the media its image tokens stand for) is about to be shared by
        several requests; compute its KV once now."""

    def generate(self, ctx: GenContext, params: GenParams) -> tuple[str, MetaInfo]:
        raise NotImplementedError

    def generate_stream(self, ctx: GenContext, params: GenParams) -> Iterator[tuple[str, MetaInfo]]:
        """Yields (new text, meta_info) chunks; the last chunk's meta_info is complete."""
        text, meta = self.generate(ctx, params)
        yield text, meta

    def generate_samples(self, ctx: GenContext, params: GenParams) -> list[tuple[str, MetaInfo]]:
        """`params.n` samples of the gen, as (text, meta_info) pairs. This default asks for them one request
        each; backends whose API samples n at once override it."""
        one = dataclasses.replace(params, n=None)
        return [self.generate(ctx, one) for _ in range(params.n or 1)]

    def generate_tool_call(self, ctx: GenContext, params: GenParams,
                           plan: ToolPlan) -> tuple[str, list[dict[str, Any]], MetaInfo]:
        """A chat model's reply to a gen with tools: (its text content, its tool calls in OpenAI's shape,
        meta_info). Completion-style backends need not implement it: the interpreter decodes calls through
        generate() with the tools' schemas."""
        raise BackendError(f"{type(self).__name__} cannot make tool calls (gen(tools=...)): use the in-process "
                           "Runtime, a RuntimeEndpoint or an OpenAI backend")

    def select(self, ctx: GenContext, choices: list[str], temperature: float,
               choices_method: str) -> ChoiceDecision:
        raise NotImplementedError(f"{type(self).__name__} cannot score choices")

    def abort(self, rid: str) -> None:
        """Best effort: stop request `rid` (an interrupted cell)."""

    def flush_cache(self) -> bool:
        return False

    def get_server_info(self) -> dict[str, Any]:
        return {"backend": type(self).__name__, "model": self.get_model_name()}

    def shutdown(self) -> None:
        pass
