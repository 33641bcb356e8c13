"""What the hosted-API backends (OpenAI, Anthropic) share: their SDKs' errors as BackendError, their usage counts,
and the checks a chat API puts on a gen."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sgnb.backends.base import BackendError, GenContext
from sgnb.sampling import GenParams


@contextmanager
def api_errors(what: str, status_error: type[BaseException], sdk_error: type[BaseException]) -> Iterator[None]:
    """Raise the SDK's errors inside as BackendError naming `what` failed (an HTTP error with its status and the
    server's message). `status_error` / `sdk_error`: the SDK's APIStatusError and its base error class."""
    try:
        yield
    except status_error as e:
        raise BackendError(f"{what} failed: HTTP {getattr(e, 'status_code', '?')}: {status_message(e)}") from e
    except sdk_error as e:
        raise BackendError(f"{what} failed: {e}") from e


def status_message(e: Any) -> str:
    """The server's own message in an SDK's HTTP error: body {"error": {"message"}}, {"message"}, else the SDK's."""
    body = getattr(e, "body", None)
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(body.get("message"), str):
            return body["message"]
    return str(getattr(e, "message", e))


class Usage(dict):
    """A backend's `usage`: calls and token counts (a plain dict to read), added to from every program's
    thread under one lock."""

    def __init__(self, *extra: str) -> None:
        super().__init__(dict.fromkeys(("calls", "prompt_tokens", "completion_tokens", *extra), 0))
        self._lock = threading.Lock()

    def add(self, counts: dict[str, int]) -> None:
        with self._lock:
            for key, value in counts.items():
                self[key] += value

    def reset(self) -> None:
        """Every count back to 0 (SGLang's TokenUsage.reset)."""
        with self._lock:
            for key in self:
                self[key] = 0

    def __getattr__(self, name: str) -> int:  # usage.prompt_tokens, as SGLang's TokenUsage reads
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def token_counts(usage: Any, prompt: str = "prompt_tokens", completion: str = "completion_tokens") -> dict[str, int]:
    """prompt_tokens / completion_tokens of an SDK's usage object (its attribute names given), 0 when absent."""
    return {"prompt_tokens": getattr(usage, prompt, 0) or 0, "completion_tokens": getattr(usage, completion, 0) or 0}


def check_assistant_turn(ctx: GenContext) -> None:
    """A chat API writes assistant turns only: a gen elsewhere is refused, saying where to put it."""
    if ctx.in_role not in (None, "assistant"):
        raise BackendError(f"a chat model writes assistant turns only, but this gen is inside {ctx.in_role!r}: "
                           "put it inside assistant(...)")


def check_one_sample(params: GenParams, backend: str) -> None:
    """The APIs are asked for one sample per gen (a program forks for more)."""
    if params.n not in (None, 1):
        raise BackendError(f"n > 1 is not supported on the {backend} backend: fork the program instead")
