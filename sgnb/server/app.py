"""Assembly: the app with its routes behind the guard, `serve` (blocking) and `ServerThread` (a notebook's)."""

from __future__ import annotations

import asyncio
import dataclasses
import http.client
import math
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from sgnb.server.access import ServerOptions, _Guard, read_timeout_protocol
from sgnb.server.native_api import NativeRoutes
from sgnb.server.protocol import _ERROR_TYPES, APIError, _engine_error
from sgnb.server.responses_api import ResponsesRoutes
from sgnb.server.streaming import EventStream, _ClientGone

if TYPE_CHECKING:
    from sgnb.engine import Engine


class _Server(NativeRoutes, ResponsesRoutes):
    """Every route handler over one engine."""


# ---- assembly ------------------------------------------------------------------------------------------------
def _handler(fn: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    async def run(request: Request) -> Response:
        try:
            return await fn(request)
        except APIError as e:
            return e.response()
        except (_ClientGone, ClientDisconnect):
            return Response(status_code=499)  # nobody reads it
        except Exception as e:
            return _engine_error(e).response()

    return run


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return APIError(exc.status_code, f"{exc.detail}: {request.method} {request.url.path}",
                    _ERROR_TYPES.get(exc.status_code, "invalid_request_error")).response()


def create_app(engine: Engine, options: ServerOptions | None = None) -> Any:
    """The ASGI app serving `engine`: SGLang's native API and the OpenAI-compatible API (see the module doc),
    behind the access and size checks of `options` (ServerOptions: loopback-only, no key, by default)."""
    options = options or ServerOptions()
    s = _Server(engine, options)
    routes = [
        Route("/generate", _handler(s.generate), methods=["POST", "PUT"]),
        Route("/get_model_info", _handler(s.get_model_info), methods=["GET"]),
        Route("/model_info", _handler(s.get_model_info), methods=["GET"]),  # newer SGLang spelling
        Route("/get_server_info", _handler(s.get_server_info), methods=["GET"]),
        Route("/server_info", _handler(s.get_server_info), methods=["GET"]),
        Route("/flush_cache", _handler(s.flush_cache), methods=["POST"]),  # admin routes change state: POST only
        Route("/health", _handler(s.health), methods=["GET"]),
        Route("/health_generate", _handler(s.health_generate), methods=["GET"]),
        Route("/abort_request", _handler(s.abort_request), methods=["POST", "PUT"]),
        Route("/concate_and_append_request", _handler(s.concat_and_append), methods=["POST"]),
        Route("/v1/models", _handler(s.list_models), methods=["GET"]),
        Route("/v1/models/{model:path}", _handler(s.retrieve_model), methods=["GET"]),
        Route("/v1/completions", _handler(s.completions), methods=["POST"]),
        Route("/v1/chat/completions", _handler(s.chat_completions), methods=["POST"]),
        Route("/v1/responses", _handler(s.responses), methods=["POST"]),
        Route("/v1/embeddings", _handler(s.embeddings), methods=["POST"]),
        Route("/tokenize", _handler(s.tokenize), methods=["POST"]),
        Route("/v1/tokenize", _handler(s.tokenize), methods=["POST"]),
        Route("/detokenize", _handler(s.detokenize), methods=["POST"]),
        Route("/v1/detokenize", _handler(s.detokenize), methods=["POST"]),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error})
    app.state.engine = engine
    return _Guard(app, options)


def _uvicorn_server(engine: Engine, host: str, port: int, log_level: str, access_log: bool,
                    options: ServerOptions | None) -> Any:
    import uvicorn

    options = dataclasses.replace(options or ServerOptions(), bound_host=host)
    config = uvicorn.Config(create_app(engine, options), host=host, port=port, log_level=log_level,
                            access_log=access_log, lifespan="off", timeout_graceful_shutdown=math.ceil(options.shutdown_grace),
                            http=read_timeout_protocol(options.request_read_timeout))
    return uvicorn.Server(config)


def serve(engine: Engine, host: str = "127.0.0.1", port: int = 30000, log_level: str = "info",
          options: ServerOptions | None = None) -> None:
    """Serve `engine` until interrupted (Ctrl-C / SIGTERM shut it down gracefully). Blocks the calling thread,
    which must have no running event loop: in Jupyter use `start_server_thread`."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        raise RuntimeError("serve() blocks and needs a thread without a running event loop; "
                           "in Jupyter use start_server_thread(engine, host, port)")
    server = _uvicorn_server(engine, host, port, log_level, access_log=True, options=options)
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(server.serve())
    finally:
        _close_loop(loop)


def _close_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel what the server left running (open streams: cancelling them aborts their engine requests), then
    close the loop."""
    try:
        pending = asyncio.all_tasks(loop)
        for task in pending:
            task.cancel()
        if pending:
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
    finally:
        loop.close()


class ServerThread:
    """The server on a background thread with its own event loop (a notebook's loop is already running).

    `port=0` picks a free port; `.url` is the address once `start()` has returned.
    """

    def __init__(self, engine: Engine, host: str = "127.0.0.1", port: int = 30000, log_level: str = "warning",
                 options: ServerOptions | None = None) -> None:
        self.host = host
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, port))
        except OSError:
            self._sock.close()
            raise
        self.port: int = self._sock.getsockname()[1]
        self._server = _uvicorn_server(engine, host, self.port, log_level, access_log=False, options=options)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"sgnb-server:{self.port}", daemon=True)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(self._server.serve(sockets=[self._sock]))
        except BaseException as e:  # reported by start()
            self._error = e
        finally:
            try:
                _close_loop(loop)
            finally:
                self._sock.close()

    def start(self, timeout: float = 30.0) -> ServerThread:
        """Start serving and wait until GET /health answers 200."""
        self._thread.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self._thread.is_alive():
                raise RuntimeError(f"the server thread exited during startup: {self._error!r}")
            if self._server.started and _health_ok(self.host, self.port):
                return self
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"the server did not answer /health within {timeout} s")

    def stop(self, timeout: float = 10.0) -> None:
        """Stop serving (open requests get up to 5 s) and join the thread. Idempotent."""
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout)
            if self._thread.is_alive():
                self._server.force_exit = True
                self._thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def __enter__(self) -> ServerThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"ServerThread({self.url}, {'running' if self.running else 'stopped'})"


def _health_ok(host: str, port: int) -> bool:
    conn = http.client.HTTPConnection(host, port, timeout=2)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


def start_server_thread(engine: Engine, host: str = "127.0.0.1", port: int = 30000,
                        log_level: str = "warning", options: ServerOptions | None = None) -> ServerThread:
    """Serve `engine` from a background thread; returns once /health answers. Stop with `.stop()`."""
    return ServerThread(engine, host, port, log_level, options).start()


__all__ = ["APIError", "EventStream", "ServerOptions", "ServerThread", "create_app", "serve", "start_server_thread"]
