"""Server-sent event streams that stop when the client goes away, interleaved engine streams, and
disconnect detection for non-streaming handlers."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.types import Receive

if TYPE_CHECKING:
    pass
from sgnb.server.protocol import _sse


# ---- streams and disconnects ----------------------------------------------------------------------------------
class _ClientGone(Exception):
    """The client closed its connection before the answer was ready."""


async def _until_disconnected(receive: Receive) -> None:
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


async def _merge(streams: list[AsyncIterator[dict]]) -> AsyncGenerator[tuple[int, dict], None]:
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
