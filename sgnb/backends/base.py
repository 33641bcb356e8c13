"""The backend protocol: what the interpreter needs from whatever runs the model.

A backend gets the program's text so far (and its chat messages) and returns generated text. Backends are
called from the programs' executor threads, concurrently: implementations must be thread-safe.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from sgnb.chat_template import PLAIN, ChatTemplate
from sgnb.sampling import GenParams


@dataclass
class GenContext:
    """What one gen/select sees: the program's text and messages, and a request id for aborts."""

    text: str
    messages: list[dict[str, Any]]
    rid: str
    images: list[Any] = field(default_factory=list)
    # per-program scratch space for backends (e.g. speculative API execution keeps its lookahead here)
    program: dict[str, Any] = field(default_factory=dict)
    num_api_spec_tokens: int | None = None
    in_role: str | None = None  # the role whose content is being written, if any


@dataclass(frozen=True)
class ChoiceDecision:
    decision: str
    meta_info: dict[str, Any]


class BackendError(RuntimeError):
    """The backend could not serve a request (a server error, an aborted request, an unsupported feature)."""


class Backend:
    """Base class. Subclasses implement generate and select; the rest have sensible defaults."""

    is_chat_model: bool = False

    def get_model_name(self) -> str:
        raise NotImplementedError

    def get_chat_template(self) -> ChatTemplate:
        return PLAIN

    def cache_prefix(self, prefix: str) -> None:
        """Frontend hint: `prefix` is about to be shared by several requests; compute its KV once now."""

    def generate(self, ctx: GenContext, params: GenParams) -> tuple[str, dict[str, Any]]:
        raise NotImplementedError

    def generate_stream(self, ctx: GenContext, params: GenParams) -> Iterator[tuple[str, dict[str, Any]]]:
        """Yields (new text, meta_info) chunks; the last chunk's meta_info is complete."""
        text, meta = self.generate(ctx, params)
        yield text, meta

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
