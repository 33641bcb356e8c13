"""sgnb serve: SGLang's native HTTP API and the OpenAI-compatible API over one in-process `Engine`.

    app = create_app(engine)                        # an ASGI app (Starlette)
    serve(engine, port=30000)                       # blocking, for the `sgnb serve` command
    handle = start_server_thread(engine, port=0)    # in a notebook: a background thread with its own loop
    handle.url, handle.stop()

Native API (what SGLang's `RuntimeEndpoint` speaks): POST /generate, GET /get_model_info (/model_info),
GET /get_server_info (/server_info), POST /flush_cache, GET /health, GET /health_generate, POST /abort_request.
OpenAI API: GET /v1/models, POST /v1/completions, POST /v1/chat/completions.

Access (ServerOptions, `sgnb serve --api-key/--admin-api-key/--allowed-hosts`): with a key, every route but
/health needs `Authorization: Bearer KEY` (401); without one, only requests for the bound address or a loopback
name, from no foreign Origin, with JSON bodies are answered (403 / 415), so a web page cannot drive the server.
Limits: the body's size (413), n, top_logprobs_num (400).

Contracts:
- Every error is JSON `{"error": {"message", "type", "param", "code"}}` with a 4xx/5xx status: malformed JSON,
  wrong types and unknown fields (request schemas forbid extras, so a typo names itself) and the engine's
  TypeError/ValueError are 400 (an invalid regex / json_schema / ebnf too); features the engine lacks (audio,
  tools) are 400 "not supported yet"; a dead engine is 503. One request's failure never affects another's.
- Images and videos (multimodal models): /generate takes SGLang's `image_data` / `video_data` (for one prompt an
  item or a list, for a batch one entry per prompt), /v1/chat/completions content parts `image_url` and
  `video_url` (an extension: {"url", "num_frames"}). Each item is a data: URL or a plain base64 string (a video
  also {"url" | "data": ..., "num_frames": n}). The server reads no local files and fetches no URLs for its
  clients: a path or an http(s) URL is a 400, as are undecodable media and media for a text-only model.
  /get_model_info, /get_server_info and /v1/models say whether the model takes images ("image_token",
  "video_token").
- A client that goes away aborts its requests: a non-streaming handler races the engine against the
  connection's `http.disconnect`; a stream stops sending and closes its engine iterators, which abort.
- Everything runs on the server's event loop; engine calls never block it (the engine works on its own thread).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import concurrent.futures
import contextlib
import dataclasses
import hmac
import http.client
import json
import logging
import math
import mimetypes
import os
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

if TYPE_CHECKING:
    from sgnb.engine import Engine

log = logging.getLogger("sgnb.server")

# SGLang frontends send these sampling names; they change nothing here (no spaces are inserted between
# special tokens when decoding), so they are dropped rather than rejected.
_IGNORED_SAMPLING_NAMES = ("spaces_between_special_tokens",)
_HEALTH_TIMEOUT_S = 20.0
_FLUSH_TIMEOUT_S = 30.0


# ---- errors ----------------------------------------------------------------------------------------------
class APIError(Exception):
    """An error answered to the client as JSON; raised anywhere below a route handler."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type, param

    def response(self) -> Response:
        return _json_response({"error": {"message": self.message, "type": self.type, "param": self.param,
                                          "code": self.status}}, self.status)


_ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
                500: "internal_server_error", 503: "service_unavailable"}


def _engine_error(e: BaseException) -> APIError:
    """Map what the engine raises for a request to an HTTP error."""
    from sgnb.engine.engine import EngineError

    if isinstance(e, NotImplementedError):
        return APIError(400, f"not supported yet: {e}")
    if isinstance(e, (TypeError, ValueError)):
        return APIError(400, str(e))
    if isinstance(e, EngineError):
        return APIError(503, str(e), "service_unavailable")
    log.exception("request failed", exc_info=e)
    return APIError(500, f"internal error: {type(e).__name__}: {e}", "internal_server_error")


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
    cross-origin ones (an Origin header that is not such a host) and POSTs that are not application/json: what
    keeps a web page (DNS rebinding, a cross-site form) from driving it. Limits answer 413 / 400.
    """

    api_key: str | None = None
    admin_api_key: str | None = None
    allowed_hosts: tuple[str, ...] = ()
    bound_host: str = "127.0.0.1"
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_n: int = 64  # samples per prompt
    max_top_logprobs_num: int = 64  # native route (the OpenAI routes allow 20, as OpenAI does)

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
        return await self.app(scope, self._bounded(receive), send)

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
            if ctype != "application/json":
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


# ---- JSON in and out ---------------------------------------------------------------------------------------
def _finite(obj: Any) -> Any:
    """Replace non-finite floats by None (as orjson does): strict JSON parsers reject Infinity and NaN."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _dumps(obj: Any) -> bytes:
    try:
        text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except ValueError:  # a -inf logprob somewhere: rare, so only then walk the object
        text = json.dumps(_finite(obj), ensure_ascii=False, separators=(",", ":"))
    return text.encode("utf-8")


def _json_response(obj: Any, status: int = 200) -> Response:
    return Response(_dumps(obj), status_code=status, media_type="application/json")


def _sse(obj: Any) -> bytes:
    return b"data: " + _dumps(obj) + b"\n\n"


_SSE_DONE = b"data: [DONE]\n\n"


async def _json_body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw.strip():
        raise APIError(400, "the request body is empty: send a JSON object")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"malformed JSON in the request body: {e}") from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _validate(schema: type[BaseModel], body: dict[str, Any]) -> Any:
    try:
        return schema.model_validate(body)
    except ValidationError as e:
        raise APIError(400, _explain(e)) from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None


def _explain(e: ValidationError) -> str:
    """One readable line per problem: `unknown field 'x'` or `field.path: what is wrong`."""
    lines: list[str] = []
    for err in e.errors(include_url=False):
        loc = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            lines.append(f"unknown field {loc!r}")
        elif err["type"] == "missing":
            lines.append(f"missing required field {loc!r}")
        else:
            lines.append(f"{loc}: {err['msg']}")
    return "invalid request: " + "; ".join(dict.fromkeys(lines))


# ---- request schemas -----------------------------------------------------------------------------------------
class _Schema(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class GenerateRequest(_Schema):
    """SGLang's /generate body (GenerateReqInput), minus what this engine cannot do."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: str | list[str] | None = None
    image_data: Any = None  # see _Media
    video_data: Any = None
    # SGLang fields accepted for compatibility: only their neutral values are
    audio_data: Any = None
    modalities: Any = None
    lora_path: Any = None
    return_hidden_states: bool = False
    custom_logit_processor: Any = None
    log_metrics: bool = True


class StreamOptions(_Schema):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _OpenAISampling(_Schema):
    """Sampling fields shared by /v1/completions and /v1/chat/completions, OpenAI's and SGLang's extras."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # SGLang extensions (sampling_params names where they differ: min_tokens -> min_new_tokens)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    regex: str | None = None
    ebnf: str | None = None
    json_schema: str | dict[str, Any] | None = None
    rid: str | None = None

    def sampling_params(self, max_new_tokens: int) -> dict[str, Any]:
        if self.logit_bias:
            raise APIError(400, "not supported yet: logit_bias", param="logit_bias")
        values = {
            "max_new_tokens": max_new_tokens, "temperature": self.temperature, "top_p": self.top_p, "n": self.n,
            "stop": self.stop, "seed": self.seed, "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty, "top_k": self.top_k, "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty, "min_new_tokens": self.min_tokens,
            "stop_token_ids": self.stop_token_ids, "stop_regex": self.stop_regex, "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens, "no_stop_trim": self.no_stop_trim,
            "regex": self.regex, "ebnf": self.ebnf, "json_schema": self.json_schema,
        }
        return {k: v for k, v in values.items() if v is not None}


class CompletionRequest(_OpenAISampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatCompletionRequest(_OpenAISampling):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    # accepted and ignored
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    reasoning_effort: str | None = None
    modalities: list[str] | None = None


class AbortRequest(_Schema):
    rid: str | None = None
    abort_all: bool = False


# ---- streams and disconnects ----------------------------------------------------------------------------------
class _ClientGone(Exception):
    """The client closed its connection before the answer was ready."""


async def _until_disconnected(receive: Callable[[], Awaitable[dict]]) -> None:
    # Called once the body has been read: the next ASGI message on the connection can only be http.disconnect.
    while (await receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Await `work`; if the client disconnects first, cancel it (the engine aborts cancelled requests)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_until_disconnected(request.receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the server is shutting down
        task.cancel()
        raise
    finally:
        watch.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise _ClientGone()
    return task.result()


class EventStream:
    """A text/event-stream response that stops as soon as the client goes away.

    It sends what `events` yields; when the client disconnects it cancels the sender and closes `events`, so
    the engine iterators underneath close and abort their requests (their KV and cache locks are freed).
    """

    def __init__(self, events: AsyncIterator[bytes]) -> None:
        self.events = events

    async def __call__(self, scope: Any, receive: Callable, send: Callable) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                                (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]})

        async def pump() -> None:
            async for data in self.events:
                await send({"type": "http.response.body", "body": data, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        sender, watcher = asyncio.ensure_future(pump()), asyncio.ensure_future(_until_disconnected(receive))
        try:
            await asyncio.wait({sender, watcher}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the server is shutting down under a client that still listens
            if not watcher.done():
                sender.cancel()
                with contextlib.suppress(Exception):
                    await send({"type": "http.response.body", "more_body": False, "body": _sse({"error": {
                        "message": "the server is shutting down: this request was aborted", "type":
                        "service_unavailable", "param": None, "code": 503}})})
            raise
        finally:
            for task in (sender, watcher):
                task.cancel()
            await asyncio.gather(sender, watcher, return_exceptions=True)
            await self.events.aclose()  # type: ignore[attr-defined]
        error = None if sender.cancelled() else sender.exception()
        if error is not None and not isinstance(error, OSError):  # OSError: the client left mid-send
            raise error


async def _merge(streams: list[AsyncIterator[dict]]) -> AsyncIterator[tuple[int, dict]]:
    """Interleave several engine streams as (stream index, chunk), in arrival order.

    Closing the merged iterator cancels the readers, which closes (and aborts) the unfinished engine streams.
    """
    queue: asyncio.Queue[tuple[int, dict | BaseException | None]] = asyncio.Queue()

    async def read(i: int, stream: AsyncIterator[dict]) -> None:
        try:
            async for chunk in stream:
                queue.put_nowait((i, chunk))
        except Exception as e:  # surfaced to the consumer
            queue.put_nowait((i, e))
        else:
            queue.put_nowait((i, None))

    readers = [asyncio.ensure_future(read(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(readers)
        while left:
            i, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in readers:
            task.cancel()
        await asyncio.gather(*readers, return_exceptions=True)


# ---- in-flight request ids (for /abort_request) ------------------------------------------------------------------
class _Inflight:
    """Request ids a client may name in /abort_request -> the engine request ids they cover (n > 1 expands)."""

    def __init__(self) -> None:
        self._ids: dict[str, list[str]] = {}

    @contextlib.contextmanager
    def track(self, ids: dict[str, list[str]]) -> Iterator[None]:
        self._ids.update(ids)
        try:
            yield
        finally:
            for key in ids:
                self._ids.pop(key, None)

    def engine_ids(self, rid: str | None, abort_all: bool) -> list[str]:
        if abort_all:
            return [r for ids in self._ids.values() for r in ids]
        return self._ids.get(rid, [rid]) if rid else []


def _new_rid() -> str:
    return uuid.uuid4().hex[:12]


def _engine_rids(base: str, n: int) -> list[str]:
    """The engine names the samples of an n > 1 request base-0 .. base-(n-1) (Engine._make_reqs)."""
    return [base] if n == 1 else [f"{base}-{j}" for j in range(n)]


def _n_of(params: dict[str, Any], max_n: int) -> int:
    n = params.get("n", 1)
    if n is None:
        return 1
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise APIError(400, f"sampling_params.n={n!r}: must be an int >= 1", param="n")
    if n > max_n:
        raise APIError(400, f"n={n}: at most {max_n} samples per prompt on this server (--max-n)", param="n")
    return n


def _split_samples(params: dict[str, Any], max_n: int) -> list[dict[str, Any]]:
    """n samples as n separate n=1 requests, seeded as the engine seeds them (seed + j)."""
    n = _n_of(params, max_n)
    if n == 1:
        return [params]
    seed = params.get("seed")
    return [{**params, "n": 1, **({"seed": seed + j} if isinstance(seed, int) else {})} for j in range(n)]


def _per_item(value: Any, count: int, name: str) -> list[Any]:
    if isinstance(value, list):
        if len(value) != count:
            raise APIError(400, f"{name} has {len(value)} entries for {count} prompts")
        return value
    return [value] * count


# ---- images and videos from clients ------------------------------------------------------------------------------
class _Media:
    """Turns a request's images and videos into what the engine takes, refusing what the server must not do for
    a client: read a local file or fetch a URL. An image becomes a data: URL (the engine decodes it) or the
    bytes of a plain base64 string; a video (the engine reads videos from files) a temporary file with its bytes,
    removed when the request's engine calls have been made (the engine reads the frames when it is called).
    Use as a context manager around those calls."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.paths: dict[str, str] = {}  # temporary file -> the request field it came from

    def __enter__(self) -> _Media:
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: object) -> None:
        for path, where in self.paths.items():
            with contextlib.suppress(OSError):
                os.unlink(path)
            if isinstance(exc, APIError):  # the engine names the file it read: name the client's field instead
                exc.message = exc.message.replace(f"video file {path!r}", f"the video of {where}").replace(path, where)

    def check_model(self, kind: str, param: str) -> str:
        """The engine's image (video) token; a 400 when the model takes none."""
        token = self.engine.image_token if kind == "image" else self.engine.video_token
        if token is None:
            name = self.engine.model_name
            raise APIError(400, f"{name} is a text-only model: it takes no images or videos"
                           if self.engine.image_token is None else f"{name} takes images but no videos", param=param)
        return token

    def prompts(self, value: Any, kind: str, param: str, batched: bool, count: int) -> list[list[Any] | None]:
        """SGLang's image_data / video_data -> one list of engine items (or None) per prompt."""
        if value is None:
            return [None] * count
        self.check_model(kind, param)
        if batched:
            entries = value if isinstance(value, list) else [value] * count  # one item for the whole batch
            if len(entries) != count:
                raise APIError(400, f"{param} has {len(entries)} entries for {count} prompts: give one entry (an "
                                    "item or a list) per prompt", param=param)
        else:
            entries = [value]
        out: list[list[Any] | None] = []
        for i, entry in enumerate(entries):
            items = entry if isinstance(entry, list) else [] if entry is None else [entry]
            where = f"{param}[{i}]" if batched else param
            out.append([self.item(x, kind, f"{where}[{j}]" if isinstance(entry, list) else where)
                        for j, x in enumerate(items)] or None)
        return out

    def item(self, value: Any, kind: str, where: str) -> Any:
        """One image (video) from the wire -> what the engine takes for it."""
        frames = None
        if kind == "video" and isinstance(value, dict):
            unknown = set(value) - {"url", "data", "num_frames"}
            if unknown or not (("url" in value) ^ ("data" in value)):
                raise APIError(400, f"{where}: a video given as an object is {{\"url\" (or \"data\"): data: URL or "
                                    f"base64, \"num_frames\": n}}, got the keys {sorted(value)}", param=where)
            frames = value.get("num_frames", 8)
            if isinstance(frames, bool) or not isinstance(frames, int) or frames < 1:
                raise APIError(400, f"{where}.num_frames must be an int >= 1, got {frames!r}", param=where)
            value = value.get("url", value.get("data"))
        if not isinstance(value, str):
            shape = "a string (a data: URL or base64)" + (" or {url, num_frames}" if kind == "video" else "")
            raise APIError(400, f"{where} must be {shape}, got {type(value).__name__}", param=where)
        text = value.strip()
        low = text.lower()
        if not text:
            raise APIError(400, f"{where} is an empty string", param=where)
        if low.startswith(("http://", "https://", "ftp://")):
            raise APIError(400, f"{where}: the {kind} URL {text[:80]!r} was not fetched: this server fetches no URLs "
                                f"for clients; send the {kind} as a data: URL or base64", param=where)
        if low.startswith("file:"):
            raise APIError(400, f"{where}: {text[:80]!r} names a local file, which this server does not read for "
                                f"clients; send the {kind}'s bytes as a data: URL or base64", param=where)
        if low.startswith("data:"):
            if kind == "image":
                return text  # the engine decodes it (a corrupt payload is its ValueError: a 400)
            header, _, payload = text.partition(",")
            if not header.lower().endswith(";base64"):
                raise APIError(400, f"{where}: a data: URL must be base64 ('data:video/mp4;base64,...'), got "
                                    f"{text[:40]!r}", param=where)
            raw = self._b64(payload, where, kind, "the data: URL's base64 payload is corrupt")
            suffix = mimetypes.guess_extension(header[5:-7].strip()) or ""
        else:
            raw = self._b64(text, where, kind, None)
            suffix = ""
        if kind == "image":
            return raw
        fd, path = tempfile.mkstemp(prefix="sgnb-video-", suffix=suffix)
        self.paths[path] = where
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
        return path if frames is None else {"path": path, "num_frames": frames}

    @staticmethod
    def _b64(text: str, where: str, kind: str, corrupt: str | None) -> bytes:
        try:
            return base64.b64decode("".join(text.split()), validate=True)
        except (binascii.Error, ValueError) as e:
            if corrupt is not None:
                raise APIError(400, f"{where}: {corrupt}: {e}", param=where) from None
            raise APIError(400, f"{where} is neither a data: URL nor base64 ({text[:60]!r}): this server reads no "
                                f"local files and fetches no URLs for clients; send the {kind}'s bytes as base64",
                           param=where) from None


# ---- the app -----------------------------------------------------------------------------------------------------
class _Server:
    """The route handlers over one engine."""

    def __init__(self, engine: Engine, options: ServerOptions) -> None:
        self.engine = engine
        self.options = options
        self.inflight = _Inflight()
        self.started = time.time()
        self.kv_total = engine.get_stats()["kv_total"]  # the KV pool's size is fixed

    # -- helpers
    def _check_alive(self) -> None:
        e = self.engine
        if not e.is_alive:
            raise APIError(503, "the engine is not running", "service_unavailable")

    async def _start_streams(self, calls: list[dict[str, Any]]) -> list[AsyncIterator[dict]]:
        """Validate and create one engine stream per call (none is submitted until iterated)."""
        streams = []
        for kw in calls:
            try:
                streams.append(await self.engine.async_generate(**kw, stream=True, fit_to_context=False))
            except Exception as e:
                raise _engine_error(e) from e
        return streams

    async def _generate(self, request: Request, **kw: Any) -> Any:
        try:
            return await _unless_disconnected(request, self.engine.async_generate(**kw, fit_to_context=False))
        except (_ClientGone, APIError):
            raise
        except Exception as e:
            raise _engine_error(e) from e

    # -- native API
    async def generate(self, request: Request) -> Response:
        req: GenerateRequest = _validate(GenerateRequest, await _json_body(request))
        for name in ("audio_data", "lora_path", "custom_logit_processor"):
            if getattr(req, name):
                raise APIError(400, f"not supported yet: {name}", param=name)
        if req.return_hidden_states:
            raise APIError(400, "not supported yet: return_hidden_states", param="return_hidden_states")
        if (req.text is None) == (req.input_ids is None):
            raise APIError(400, "give exactly one of text or input_ids")
        source = req.text if req.text is not None else req.input_ids
        prompt_key = "prompt" if req.text is not None else "input_ids"
        batched = isinstance(req.text, list) or (bool(req.input_ids) and isinstance(req.input_ids[0], list))
        prompts: list[Any] = list(source) if batched else [source]  # type: ignore[arg-type]
        count = len(prompts)
        if count == 0:
            raise APIError(400, "an empty batch of prompts")
        if batched and isinstance(req.rid, str):
            raise APIError(400, "rid must be a list with one id per prompt for a batch", param="rid")
        params = [self._native_sampling(p) for p in _per_item(req.sampling_params, count, "sampling_params")]
        rids = [r or _new_rid() for r in _per_item(req.rid, count, "rid")]
        lps = [bool(x) for x in _per_item(req.return_logprob, count, "return_logprob")]
        starts = [-1 if x is None else x for x in _per_item(req.logprob_start_len, count, "logprob_start_len")]
        tops = [0 if x is None else x for x in _per_item(req.top_logprobs_num, count, "top_logprobs_num")]
        ids = {r: _engine_rids(r, _n_of(p, self.options.max_n)) for r, p in zip(rids, params)}
        if any(t > self.options.max_top_logprobs_num for t in tops if isinstance(t, int)):
            raise APIError(400, f"top_logprobs_num: at most {self.options.max_top_logprobs_num} on this server "
                                "(--max-top-logprobs-num)", param="top_logprobs_num")

        with _Media(self.engine) as media:
            images = media.prompts(req.image_data, "image", "image_data", batched, count)
            videos = media.prompts(req.video_data, "video", "video_data", batched, count)

            def media_kw(i: int | None) -> dict[str, Any]:  # prompt i's media; None: every prompt's (a batch)
                kw: dict[str, Any] = {}
                for key, per in (("image_data", images), ("video_data", videos)):
                    if any(x is not None for x in per):
                        kw[key] = per if i is None else per[i]
                return kw

            if not req.stream:
                def pick(values: list[Any]) -> Any:  # per prompt for a batch, the one value otherwise
                    return values if batched else values[0]

                with self.inflight.track(ids):
                    out = await self._generate(
                        request, **{prompt_key: source}, sampling_params=pick(params), return_logprob=pick(lps),
                        logprob_start_len=pick(starts), top_logprobs_num=pick(tops),
                        return_text_in_logprobs=req.return_text_in_logprobs, rid=pick(rids),
                        **media_kw(None if batched else 0))
                return _json_response(out)

            calls = []
            for i, prompt in enumerate(prompts):
                for sp, rid in zip(_split_samples(params[i], self.options.max_n), ids[rids[i]]):
                    calls.append({prompt_key: prompt, "sampling_params": sp,
                                  "return_logprob": lps[i], "logprob_start_len": starts[i],
                                  "top_logprobs_num": tops[i], "return_text_in_logprobs": req.return_text_in_logprobs,
                                  "rid": rid, **media_kw(i)})
            streams = await self._start_streams(calls)  # the engine has read the media here
        indexed = batched or len(calls) > 1
        return EventStream(self._native_events(streams, ids, indexed))  # type: ignore[return-value]

    @staticmethod
    def _native_sampling(params: dict[str, Any] | None) -> dict[str, Any]:
        params = dict(params or {})
        for name in _IGNORED_SAMPLING_NAMES:
            params.pop(name, None)
        return params

    async def _native_events(self, streams: list[AsyncIterator[dict]], ids: dict[str, list[str]],
                             indexed: bool) -> AsyncIterator[bytes]:
        """SGLang's stream format: each chunk carries the cumulative text so far; then `data: [DONE]`."""
        texts = [""] * len(streams)
        with self.inflight.track(ids):
            try:
                async with contextlib.aclosing(_merge(streams)) as chunks:
                    async for i, chunk in chunks:
                        texts[i] += chunk["text"]
                        out = {**chunk, "text": texts[i]}
                        if "output_ids" not in chunk:  # not the last chunk
                            out["meta_info"] = {**chunk["meta_info"], "finish_reason": None}
                        if indexed:
                            out["index"] = i
                        yield _sse(out)
            except Exception as e:
                yield _sse({"error": {"message": _engine_error(e).message}})
            yield _SSE_DONE

    async def get_model_info(self, request: Request) -> Response:
        e = self.engine
        return _json_response({
            "model_path": e.config.model_path,
            "tokenizer_path": e.config.model_path,
            "model_name": e.model_name,
            "is_generation": True,
            "context_length": e.context_length,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": e.image_token is not None,
            "has_audio_understanding": False,
            "image_token": e.image_token,
            "video_token": e.video_token,
            "chat_template": e.tokenizer.chat_template,
        })

    async def get_server_info(self, request: Request) -> Response:
        from sgnb import __version__

        e = self.engine
        stats = e.get_stats()
        return _json_response({
            **dataclasses.asdict(e.config),
            "model_name": e.model_name,
            "context_length": e.context_length,
            "max_total_num_tokens": stats["kv_total"],
            "load_seconds": getattr(e, "load_seconds", None),
            "uptime_s": time.time() - self.started,
            "internal_states": [stats],
            "version": __version__,
            "has_image_understanding": e.image_token is not None,
            "image_token": e.image_token,
            "video_token": e.video_token,
        })

    async def flush_cache(self, request: Request) -> Response:
        self._check_alive()
        try:
            # waits until no request is in flight; on a timeout the flush still happens once the engine is idle
            ok = await asyncio.to_thread(self.engine.flush_cache, _FLUSH_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            ok = False
        if not ok:
            raise APIError(400, f"the cache was not flushed within {_FLUSH_TIMEOUT_S:.0f} s: requests are "
                                "still running (it will be flushed once the engine is idle)")
        return Response("Cache flushed.\n", media_type="text/plain")

    async def health(self, request: Request) -> Response:
        self._check_alive()
        return Response(status_code=200)

    async def health_generate(self, request: Request) -> Response:
        """Healthy when the engine generates one token within the timeout."""
        self._check_alive()
        tok = self.engine.tokenizer.bos_token_id or 0
        rid = f"HEALTH_CHECK_{_new_rid()}"
        try:
            out = await asyncio.wait_for(self.engine.async_generate(
                input_ids=[tok], sampling_params={"max_new_tokens": 1, "temperature": 0}, rid=rid), _HEALTH_TIMEOUT_S)
        except Exception as e:  # asyncio.TimeoutError included
            raise APIError(503, f"the engine did not generate: {type(e).__name__}: {e}", "service_unavailable") from e
        if out["meta_info"]["finish_reason"]["type"] == "abort":
            raise APIError(503, f"the engine failed to generate: {out['meta_info'].get('error')}", "service_unavailable")
        return Response(status_code=200)

    async def abort_request(self, request: Request) -> Response:
        req: AbortRequest = _validate(AbortRequest, await _json_body(request))
        if not req.rid and not req.abort_all:
            raise APIError(400, "give rid or abort_all=true")
        for rid in self.inflight.engine_ids(req.rid, req.abort_all):
            self.engine.abort(rid)
        return Response(status_code=200)

    # -- OpenAI API
    async def list_models(self, request: Request) -> Response:
        return _json_response({"object": "list", "data": [self._model_card()]})

    def _model_card(self) -> dict[str, Any]:
        e = self.engine
        modalities = ["text"] + ["image"] * (e.image_token is not None) + ["video"] * (e.video_token is not None)
        return {"id": e.model_name, "object": "model", "created": int(self.started), "owned_by": "sgnb",
                "root": e.config.model_path, "max_model_len": e.context_length, "input_modalities": modalities,
                "has_image_understanding": e.image_token is not None}

    async def completions(self, request: Request) -> Response:
        req: CompletionRequest = _validate(CompletionRequest, await _json_body(request))
        if req.suffix:
            raise APIError(400, "not supported yet: suffix", param="suffix")
        if req.best_of not in (None, req.n):
            raise APIError(400, "not supported yet: best_of other than n", param="best_of")
        prompt = req.prompt
        batched = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)
        prompts: list[Any] = list(prompt) if batched else [prompt]  # type: ignore[arg-type]
        if not prompts:
            raise APIError(400, "prompt is an empty list", param="prompt")
        sp = req.sampling_params(req.max_tokens if req.max_tokens is not None else 16)
        want_lp = req.logprobs is not None
        base = req.rid or _new_rid()
        rids = [base] if len(prompts) == 1 else [f"{base}-p{i}" for i in range(len(prompts))]
        _n_of({"n": req.n}, self.options.max_n)
        ids = {base: [r for rid in rids for r in _engine_rids(rid, req.n)]}
        lp_kw = {"return_logprob": want_lp, "top_logprobs_num": req.logprobs or 0,
                 "logprob_start_len": 0 if req.echo and want_lp else -1, "return_text_in_logprobs": True}
        meta = {"id": f"cmpl-{base}", "created": int(time.time()), "model": self.engine.model_name}
        tokens = self.engine.tokenizer

        def prompt_kw(p: Any) -> dict[str, Any]:
            return {"prompt": p} if isinstance(p, str) else {"input_ids": p}

        def echo_text(i: int) -> str:
            p = prompts[i]
            return p if isinstance(p, str) else tokens.decode(p)

        if not req.stream:
            with self.inflight.track(ids):
                if batched:
                    outs = await self._generate(request, **_batch_kw(prompts), sampling_params=sp, rid=rids, **lp_kw)
                else:
                    outs = await self._generate(request, **prompt_kw(prompts[0]), sampling_params=sp, rid=rids[0],
                                                **lp_kw)
            outs = outs if isinstance(outs, list) else [outs]
            _raise_failed(outs)
            choices = []
            for k, out in enumerate(outs):
                prefix = echo_text(k // req.n) if req.echo else ""
                choices.append({"index": k, "text": prefix + out["text"],
                                "logprobs": _completion_logprobs(out, req.echo) if want_lp else None,
                                **_finish(out)})
            return _json_response({**meta, "object": "text_completion", "choices": choices,
                                   "usage": _usage(outs, req.n)})

        calls = [{**prompt_kw(p), "sampling_params": s, "rid": r, **lp_kw}
                 for i, p in enumerate(prompts)
                 for s, r in zip(_split_samples(sp, self.options.max_n), _engine_rids(rids[i], req.n))]
        streams = await self._start_streams(calls)
        head = [{"index": k, "text": echo_text(k // req.n), "logprobs": None, "finish_reason": None}
                for k in range(len(calls))] if req.echo else []

        def choice(k: int, chunk: dict, last: bool) -> dict[str, Any]:
            return {"index": k, "text": chunk["text"],
                    "logprobs": _completion_logprobs(chunk, False) if last and want_lp else None,
                    **(_finish(chunk) if last else {"finish_reason": None})}

        return EventStream(self._openai_events(  # type: ignore[return-value]
            streams, ids, {**meta, "object": "text_completion"}, head, choice, req.stream_options, req.n))

    async def chat_completions(self, request: Request) -> Response:
        req: ChatCompletionRequest = _validate(ChatCompletionRequest, await _json_body(request))
        if (req.tools or req.functions) and req.tool_choice != "none":
            raise APIError(400, "not supported yet: tools / function calling", param="tools")
        if req.top_logprobs and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        sp_extra = _response_format(req.response_format or {})

        with _Media(self.engine) as media:
            return await self._chat(request, req, sp_extra, media)

    async def _chat(self, request: Request, req: ChatCompletionRequest, sp_extra: dict[str, Any],
                    media: _Media) -> Response:
        text, images, videos = self._render_chat(req.messages, media)
        mm = {**({"image_data": images} if images else {}), **({"video_data": videos} if videos else {})}
        input_ids = self.engine.tokenizer.encode(text)
        limit = min(self.engine.context_length, self.kv_total)
        max_new = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        sp = {**req.sampling_params(max_new if max_new is not None else max(limit - len(input_ids), 1)), **sp_extra}
        _n_of({"n": req.n}, self.options.max_n)
        base = req.rid or _new_rid()
        ids = {base: _engine_rids(base, req.n)}
        lp_kw = {"return_logprob": req.logprobs, "top_logprobs_num": req.top_logprobs or 0,
                 "return_text_in_logprobs": True}
        meta = {"id": f"chatcmpl-{base}", "created": int(time.time()), "model": self.engine.model_name}

        if not req.stream:
            with self.inflight.track(ids):
                outs = await self._generate(request, input_ids=input_ids, sampling_params=sp, rid=base, **lp_kw,
                                            **mm)
            outs = outs if isinstance(outs, list) else [outs]
            _raise_failed(outs)
            choices = [{"index": k, "message": {"role": "assistant", "content": out["text"]},
                        "logprobs": _chat_logprobs(out) if req.logprobs else None, **_finish(out)}
                       for k, out in enumerate(outs)]
            return _json_response({**meta, "object": "chat.completion", "choices": choices,
                                   "usage": _usage(outs, req.n)})

        calls = [{"input_ids": input_ids, "sampling_params": s, "rid": r, **lp_kw, **mm}
                 for s, r in zip(_split_samples(sp, self.options.max_n), ids[base])]
        streams = await self._start_streams(calls)
        head = [{"index": k, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for k in range(len(calls))]

        def choice(k: int, chunk: dict, last: bool) -> dict[str, Any]:
            return {"index": k, "delta": {"content": chunk["text"]} if chunk["text"] or not last else {},
                    "logprobs": _chat_logprobs(chunk) if last and req.logprobs else None,
                    **(_finish(chunk) if last else {"finish_reason": None})}

        return EventStream(self._openai_events(  # type: ignore[return-value]
            streams, ids, {**meta, "object": "chat.completion.chunk"}, head, choice, req.stream_options, req.n))

    async def _openai_events(self, streams: list[AsyncIterator[dict]], ids: dict[str, list[str]],
                             meta: dict[str, Any], head: list[dict], choice: Callable[[int, dict, bool], dict],
                             options: StreamOptions | None, n: int) -> AsyncIterator[bytes]:
        """OpenAI's stream: the `head` choices, one chunk per engine chunk (logprobs and finish_reason come with
        a choice's last chunk), a usage chunk when stream_options.include_usage, then `data: [DONE]`."""
        include_usage = bool(options and options.include_usage)
        usage = {"usage": None} if include_usage else {}
        finals: list[dict] = [{}] * len(streams)
        with self.inflight.track(ids):
            try:
                for c in head:
                    yield _sse({**meta, "choices": [c], **usage})
                async with contextlib.aclosing(_merge(streams)) as chunks:
                    async for k, chunk in chunks:
                        last = "output_ids" in chunk
                        if last:
                            finals[k] = chunk
                            _raise_failed([chunk])
                        yield _sse({**meta, "choices": [choice(k, chunk, last)], **usage})
                if include_usage:
                    yield _sse({**meta, "choices": [], "usage": _usage(finals, n)})
            except Exception as e:
                err = e if isinstance(e, APIError) else _engine_error(e)
                yield _sse({"error": {"message": err.message, "type": err.type, "code": err.status}})
            yield _SSE_DONE

    def _render_chat(self, messages: list[dict[str, Any]], media: _Media) -> tuple[str, list[Any], list[Any]]:
        """The prompt text (the chat template over the messages) and its images and videos in order. A content
        list's text parts are joined by newlines; an image_url (video_url) part becomes the model's image (video)
        token in its place, with nothing around it, so text + image + text reads back as it was split."""
        rendered, images, videos = [], [], []
        for i, m in enumerate(messages):
            role = m.get("role")
            if role not in ("system", "developer", "user", "assistant", "tool"):
                raise APIError(400, f"messages[{i}].role must be system, developer, user, assistant or tool, "
                                    f"got {role!r}", param="messages")
            content = m.get("content")
            if isinstance(content, list):
                pieces, after_text = [], False
                for j, part in enumerate(content):
                    kind = part.get("type") if isinstance(part, dict) else None
                    where = f"messages[{i}].content[{j}]"
                    if kind == "text":
                        pieces += ["\n", str(part.get("text", ""))] if after_text else [str(part.get("text", ""))]
                        after_text = True
                    elif kind in ("image_url", "video_url"):
                        pieces.append(self._media_part(part, kind, where, media, images, videos))
                        after_text = False
                    else:
                        raise APIError(400, f"not supported yet: {where} of type {kind!r} (text, image_url, "
                                            "video_url)", param="messages")
                content = "".join(pieces)
            elif content is None:
                content = ""
            elif not isinstance(content, str):
                raise APIError(400, f"messages[{i}].content must be a string or a list of parts", param="messages")
            msg = {"role": role, "content": content}
            if isinstance(m.get("name"), str):
                msg["name"] = m["name"]
            rendered.append(msg)
        try:
            return self.engine.tokenizer.apply_chat_template(rendered, add_generation_prompt=True), images, videos
        except Exception as e:
            raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from e

    @staticmethod
    def _media_part(part: dict[str, Any], kind: str, where: str, media: _Media, images: list[Any],
                    videos: list[Any]) -> str:
        """An image_url / video_url content part -> the model's token for it; the item joins images / videos."""
        spec = part.get(kind)
        if isinstance(spec, str):  # some clients send the URL alone
            spec = {"url": spec}
        if not isinstance(spec, dict) or not isinstance(spec.get("url"), str):
            raise APIError(400, f'{where}.{kind} must be {{"url": "data:..."}}', param="messages")
        if kind == "image_url":
            token = media.check_model("image", "messages")
            images.append(media.item(spec["url"], "image", f"{where}.image_url.url"))
        else:
            token = media.check_model("video", "messages")
            item = {"url": spec["url"], **({"num_frames": spec["num_frames"]} if "num_frames" in spec else {})}
            videos.append(media.item(item, "video", f"{where}.video_url"))
        return token


# ---- OpenAI request and response pieces ------------------------------------------------------------------------
def _response_format(fmt: dict[str, Any]) -> dict[str, Any]:
    """response_format -> sampling params (json_object and json_schema become a JSON-schema constraint)."""
    kind = fmt.get("type", "text")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_schema": '{"type": "object"}'}
    spec = fmt.get("json_schema")
    if kind == "json_schema" and isinstance(spec, dict) and isinstance(spec.get("schema", {}), dict):
        return {"json_schema": json.dumps(spec.get("schema", {}))}
    raise APIError(400, "response_format must be {type: text}, {type: json_object} or "
                        "{type: json_schema, json_schema: {schema: {...}}}", param="response_format")


def _batch_kw(prompts: list[Any]) -> dict[str, Any]:
    if all(isinstance(p, str) for p in prompts):
        return {"prompt": prompts}
    if all(isinstance(p, list) for p in prompts):
        return {"input_ids": prompts}
    raise APIError(400, "prompt: mix of text and token ids", param="prompt")


def _raise_failed(outs: list[dict]) -> None:
    """A request the engine failed on (finish_reason abort with an error) is a 500 for OpenAI clients."""
    for out in outs:
        error = out["meta_info"].get("error")
        if error:
            raise APIError(500, f"generation failed: {error}", "internal_server_error")


def _finish(out: dict) -> dict[str, Any]:
    reason = out["meta_info"]["finish_reason"] or {}
    kind = reason.get("type")
    return {"finish_reason": kind, "matched_stop": reason.get("matched") if kind == "stop" else None}


def _usage(outs: list[dict], n: int) -> dict[str, Any]:
    """Prompt tokens count once per prompt (the n samples of a prompt share it); completions add up."""
    metas = [o["meta_info"] for o in outs if o]
    firsts = [m for k, m in enumerate(metas) if k % n == 0]
    prompt = sum(m["prompt_tokens"] for m in firsts)
    completion = sum(m["completion_tokens"] for m in metas)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(m["cached_tokens"] for m in firsts)}}


def _completion_logprobs(out: dict, echo: bool) -> dict[str, Any]:
    """The legacy completions format: tokens, token_logprobs, top_logprobs (token -> logprob), text_offset.
    With echo the prompt's tokens come first (the first has no logprob)."""
    meta = out["meta_info"]
    inputs = list(meta.get("input_token_logprobs") or []) if echo else []
    outputs = list(meta.get("output_token_logprobs") or [])
    tops = ((list(meta.get("input_top_logprobs") or [None] * len(inputs)) if echo else [])
            + list(meta.get("output_top_logprobs") or [None] * len(outputs)))
    entries = inputs + outputs
    offset, tokens, offsets = 0, [], []
    for _, _, text in entries:
        tokens.append(text or "")
        offsets.append(offset)
        offset += len(text or "")
    return {"tokens": tokens, "token_logprobs": [lp for lp, _, _ in entries],
            "top_logprobs": [None if t is None else {text or "": lp for lp, _, text in t} for t in tops],
            "text_offset": offsets}


def _chat_logprobs(out: dict) -> dict[str, Any]:
    meta = out["meta_info"]
    entries = meta.get("output_token_logprobs") or []
    tops = meta.get("output_top_logprobs") or [None] * len(entries)

    def item(lp: float, text: str | None) -> dict[str, Any]:
        text = text or ""
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(lp, text), "top_logprobs": [item(tlp, tt) for tlp, _, tt in (top or [])]}
                        for (lp, _, text), top in zip(entries, tops)]}


# ---- assembly ------------------------------------------------------------------------------------------------
def _handler(fn: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    async def run(request: Request) -> Response:
        try:
            return await fn(request)
        except APIError as e:
            return e.response()
        except _ClientGone:
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
        Route("/v1/models", _handler(s.list_models), methods=["GET"]),
        Route("/v1/completions", _handler(s.completions), methods=["POST"]),
        Route("/v1/chat/completions", _handler(s.chat_completions), methods=["POST"]),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error})
    app.state.engine = engine
    return _Guard(app, options)


def _uvicorn_server(engine: Engine, host: str, port: int, log_level: str, access_log: bool,
                    options: ServerOptions | None) -> Any:
    import uvicorn

    options = dataclasses.replace(options or ServerOptions(), bound_host=host)
    config = uvicorn.Config(create_app(engine, options), host=host, port=port, log_level=log_level,
                            access_log=access_log, lifespan="off", timeout_graceful_shutdown=5)
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
