"""Interrupting a cell: abort every request its program (and the program's forks) has in flight.

A program's executors each know only their own current request, and a fork's branches run on threads of their
own; the cell therefore runs on an `InterruptibleBackend`, a view of the real backend that sees every request
the cell's program makes. `interrupt()` refuses new requests, aborts the in-flight ones and waits until their
calls have returned, by which time the engine has released their cache locks and KV slots.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from sgnb.backends.base import Backend, BackendError, ChoiceDecision, GenContext
from sgnb.chat_template import ChatTemplate
from sgnb.engine.meta_info import MetaInfo
from sgnb.media import Media
from sgnb.sampling import GenParams

T = TypeVar("T")


class CellInterrupted(BackendError):
    """The cell was interrupted: its program makes no new requests."""


class InterruptibleBackend(Backend):
    """Delegates to `backend`; remembers the request ids in flight. Thread-safe, like every backend."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.is_chat_model = backend.is_chat_model
        self._inflight: dict[str, int] = {}
        self._cond = threading.Condition()
        self._interrupted = False

    def __getattr__(self, name: str) -> Any:  # anything backend-specific (e.g. Runtime.engine)
        return getattr(self.backend, name)

    # Backend's class attributes would shadow __getattr__: what the backend takes is the backend's to say
    @property
    def image_token(self) -> str | None:  # type: ignore[override]
        return self.backend.image_token

    @property
    def video_token(self) -> str | None:  # type: ignore[override]
        return self.backend.video_token

    @property
    def fetches_urls(self) -> bool:  # type: ignore[override]
        return self.backend.fetches_urls

    # ---- bookkeeping -------------------------------------------------------------------------------------
    def _enter(self, rid: str) -> None:
        with self._cond:
            if self._interrupted:
                raise CellInterrupted("the cell was interrupted")
            self._inflight[rid] = self._inflight.get(rid, 0) + 1

    def _exit(self, rid: str) -> None:
        with self._cond:
            self._inflight[rid] -= 1
            if not self._inflight[rid]:
                del self._inflight[rid]
            self._cond.notify_all()

    def _tracked(self, rid: str, call: Callable[[], T]) -> T:
        self._enter(rid)
        try:
            return call()
        finally:
            self._exit(rid)

    @property
    def inflight(self) -> list[str]:
        with self._cond:
            return list(self._inflight)

    def interrupt(self, timeout: float = 30.0) -> bool:
        """Refuse new requests, abort those in flight and wait for their calls to return (the engine may see
        an abort before the request it names: keep aborting until the call is back). True when all are back."""
        with self._cond:
            self._interrupted = True
        deadline = time.monotonic() + timeout
        while True:
            rids = self.inflight
            if not rids:
                return True
            if time.monotonic() > deadline:
                return False
            for rid in rids:
                self.backend.abort(rid)
            with self._cond:
                self._cond.wait(0.05)

    # ---- the Backend protocol ----------------------------------------------------------------------------
    def get_model_name(self) -> str:
        return self.backend.get_model_name()

    def get_chat_template(self) -> ChatTemplate:
        return self.backend.get_chat_template()

    def media_token(self, media: Media) -> str:
        return self.backend.media_token(media)

    def cache_prefix(self, prefix: str, images: list[Media] | None = None) -> None:
        if self._interrupted:
            raise CellInterrupted("the cell was interrupted")
        if images:
            self.backend.cache_prefix(prefix, images)
        else:  # a backend written before images takes one argument
            self.backend.cache_prefix(prefix)

    def generate(self, ctx: GenContext, params: GenParams) -> tuple[str, MetaInfo]:
        return self._tracked(ctx.rid, lambda: self.backend.generate(ctx, params))

    def generate_stream(self, ctx: GenContext, params: GenParams) -> Iterator[tuple[str, MetaInfo]]:
        self._enter(ctx.rid)
        try:
            yield from self.backend.generate_stream(ctx, params)
        finally:
            self._exit(ctx.rid)

    def select(self, ctx: GenContext, choices: list[str], temperature: float,
               choices_method: str) -> ChoiceDecision:
        return self._tracked(ctx.rid, lambda: self.backend.select(ctx, choices, temperature, choices_method))

    def abort(self, rid: str) -> None:
        self.backend.abort(rid)

    def flush_cache(self) -> bool:
        return self.backend.flush_cache()

    def get_server_info(self) -> dict[str, Any]:
        return self.backend.get_server_info()
