"""Who may call the server and how much one request may ask for: ServerOptions and the ASGI guard."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    pass
from sgnb.server.protocol import APIError

# ---- limits and access -------------------------------------------------------------------------------------
DEFAULT_MAX_REQUEST_BYTES = 8 << 20
_LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
_ADMIN_PATHS = ("/flush_cache", "/abort_request")
_OPEN_PATHS = ("/health",)  # answered without a key (load balancers, start_server_thread's readiness check)


@dataclass(frozen=True)
class ServerOptions:
    """Who may call the server and how much one request may ask for.

    api_key: every route but /health needs `Authorization: Bearer <api_key>`; admin_api_key, when set, is the
    only key the admin routes (flush_cache, abort_request) take. Without an api_key the server answers only
    requests whose Host is the bound address, a loopback name or one of allowed_hosts ("*": any), refuses
    cross-origin ones (an Origin header that is not such a host) and POSTs with a body that is not
    application/json: what keeps a web page (DNS rebinding, a cross-site form) from driving it. A POST without
    a body or a Content-Type (`curl -X POST .../flush_cache`) is answered. Limits answer 413 / 400.

    incremental_streaming_output (SGLang's `--incremental-streaming-output`): /generate stream chunks carry the
    new text, output ids and output logprobs only (by default the text and logprobs so far, as SGLang's default).

    strict_model_name (`--strict-model-name`): a request to the OpenAI routes whose `model` is not the served
    name is a 404 with code model_not_found, as OpenAI answers; by default any name is served, as SGLang does.
    """

    api_key: str | None = None
    admin_api_key: str | None = None
    allowed_hosts: tuple[str, ...] = ()
    bound_host: str = "127.0.0.1"
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_n: int = 64  # samples per prompt
    max_samples: int = 512  # samples per request: prompts x n (a 60 KB batch could ask for 192,000)
    max_top_logprobs_num: int = 64  # native route (the OpenAI routes allow 20, as OpenAI does)
    incremental_streaming_output: bool = False
    strict_model_name: bool = False  # an OpenAI request naming another model is a 404 model_not_found
    shutdown_grace: float = 5.0  # seconds requests in flight may run on once shutdown starts; then aborted
    request_read_timeout: float = 30.0  # seconds a connection has to send a whole request (head and body)

    def __post_init__(self) -> None:
        for name in ("max_n", "max_samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.request_read_timeout > 0:
            raise ValueError(f"request_read_timeout must be > 0 seconds, got {self.request_read_timeout}")
        if self.shutdown_grace < 0:
            raise ValueError(f"shutdown_grace must be >= 0 seconds, got {self.shutdown_grace}")

    def host_allowed(self, host: str) -> bool:
        if "*" in self.allowed_hosts:
            return True
        return host in _LOOPBACK_NAMES or host == self.bound_host or host in self.allowed_hosts


def _hostname(value: str) -> str:
    """The host part of a Host header or an Origin URL ("http://[::1]:8000" -> "::1")."""
    if "://" in value:
        value = value.split("://", 1)[1]
    value = value.split("/", 1)[0]
    if value.startswith("["):
        return value[1:].split("]", 1)[0]
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


class _Guard:
    """ASGI middleware in front of every route: keys, hosts and origins, the body's size (ServerOptions)."""

    def __init__(self, app: Any, options: ServerOptions) -> None:
        self.app, self.options = app, options

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        refusal = self._refusal(scope)
        if refusal is not None:
            status, message, kind = refusal
            response = APIError(status, message, kind).response()
            if status == 401:
                response.headers["WWW-Authenticate"] = "Bearer"
            return await response(scope, receive, send)
        started = False

        async def tracked(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, self._bounded(receive), tracked)
        except asyncio.CancelledError:
            # Only the server cancels a request's task: when shutdown's grace period is over (uvicorn) or as its
            # loop closes. The handlers aborted their engine requests on the way out (a stream also sent its
            # last error event); answer a request that got no response yet, and end quietly (re-raised, uvicorn
            # logs the cancellation as a crash of the application).
            if not started:
                with contextlib.suppress(Exception):
                    await APIError(503, "the server is shutting down: this request was aborted",
                                   "service_unavailable").response()(scope, receive, send)

    def _refusal(self, scope: dict) -> tuple[int, str, str] | None:
        opts = self.options
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        path = scope.get("path", "")
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > opts.max_request_bytes:
            return 413, (f"the request body is {int(length)} bytes, over the server's limit of "
                         f"{opts.max_request_bytes} (--max-request-bytes)"), "invalid_request_error"
        if opts.api_key is not None:
            if path in _OPEN_PATHS:
                return None
            keys = [opts.admin_api_key] if (path in _ADMIN_PATHS and opts.admin_api_key) else [opts.api_key]
            if path not in _ADMIN_PATHS and opts.admin_api_key:
                keys.append(opts.admin_api_key)
            given = headers.get("authorization", "")
            token = given[7:] if given[:7].lower() == "bearer " else ""
            if not any(hmac.compare_digest(token.encode(), k.encode()) for k in keys):
                what = "an admin API key" if path in _ADMIN_PATHS and opts.admin_api_key else "an API key"
                return 401, f"{path} needs {what}: send Authorization: Bearer <key>", "authentication_error"
            return None
        host = _hostname(headers.get("host", ""))
        if not opts.host_allowed(host):
            return 403, (f"Host {host!r} is not allowed (a page on another site may be driving this server): "
                         "start the server with --allowed-hosts HOST or with --api-key"), "permission_error"
        origin = headers.get("origin")
        if origin is not None and not opts.host_allowed(_hostname(origin)):
            return 403, f"cross-origin request from {origin!r} refused (start the server with --api-key)", \
                "permission_error"
        if scope.get("method") in ("POST", "PUT"):
            ctype = headers.get("content-type", "").split(";", 1)[0].strip().lower()
            # A POST with no body and no Content-Type (`curl -X POST .../flush_cache`) is not a form a page could
            # send: a page's bodiless POST carries its Origin, refused above; a form always has a Content-Type.
            bodiless = not ctype and headers.get("content-length", "0") == "0" and "transfer-encoding" not in headers
            if ctype != "application/json" and not bodiless:
                return 415, (f"POST bodies must be JSON with Content-Type: application/json (got "
                             f"{ctype or 'none'!r})"), "invalid_request_error"
        return None

    def _bounded(self, receive: Callable) -> Callable:
        """receive, counting body bytes (a chunked body has no Content-Length): past the limit it raises the
        413 APIError, which the route's handler answers."""
        limit, seen = self.options.max_request_bytes, [0]

        async def bounded() -> dict:
            message = await receive()
            if message["type"] == "http.request":
                seen[0] += len(message.get("body", b""))
                if seen[0] > limit:
                    raise APIError(413, f"the request body is over the server's limit of {limit} bytes "
                                        "(--max-request-bytes)")
            return message

        return bounded


# ---- slow clients ------------------------------------------------------------------------------------------
def read_timeout_protocol(seconds: float) -> type:
    """uvicorn's HTTP/1.1 protocol (h11) with a deadline for reading each request: a connection that has not sent
    a whole request (its head and its body) `seconds` after it opened, or after its previous response, is closed.
    Connections that trickle a byte at a time (slow-loris) would otherwise be held forever; a request that was
    read in time may take as long as it needs to answer."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class ReadTimeoutH11Protocol(H11Protocol):
        _read_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED, h11.ERROR):
                self._disarm()  # the request is read: answering it has no deadline

        def on_response_complete(self) -> None:
            self._arm()  # the next request's clock (a pipelined one already read disarms it at once)
            super().on_response_complete()

        def _arm(self) -> None:
            self._disarm()
            self._read_timer = self.loop.call_later(seconds, self._timed_out)

        def _disarm(self) -> None:
            if self._read_timer is not None:
                self._read_timer.cancel()
                self._read_timer = None

        def _timed_out(self) -> None:
            self._read_timer = None
            if not self.transport.is_closing():
                self.transport.close()  # a handler still reading the body sees the client gone

    return ReadTimeoutH11Protocol
