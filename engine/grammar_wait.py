"""Waiting for a generate call's grammars: each compiled before its requests are submitted, within
`grammar_compile_timeout`.

`_make_reqs` starts one compile per distinct constraint (`GrammarBackend.compile_async`) and holds a claim on it;
`compiled` (awaitable) / `compiled_sync` (blocking, interruptible) wait for them, raise what a compile raised (its
ValueError) or the timeout's ValueError, and however the wait ends release the claims, so a compile nobody waits
for is dropped before it starts. `constrained` says whether a call's sampling params hold a constraint at all.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import time
from collections.abc import Callable
from typing import Any

from sgnb.engine.events import wait_slice
from sgnb.engine.request import Req
from sgnb.engine.request_output import set_once
from sgnb.engine.sampling_params import SamplingParams

Grammars = dict[tuple[str, str], Any]  # (kind, source) -> its compile's concurrent future


def constrained(sampling_params: Any) -> bool:
    """Whether a generate call's sampling params (a dict or SamplingParams, or one per prompt) hold a regex /
    JSON schema / EBNF."""
    per = sampling_params if isinstance(sampling_params, list) else [sampling_params]
    values = [p if isinstance(p, dict) else vars(p) for p in per if isinstance(p, (dict, SamplingParams))]
    return any(v.get(k) is not None for v in values for k in ("regex", "json_schema", "ebnf"))


async def compiled(reqs: list[Req], timeout: float, backend: Callable[[], Any]) -> None:
    """Wait until the requests' grammars compiled (`backend`: the engine's grammar_backend, whose claims are
    released)."""
    grammars = _grammars(reqs)
    if not grammars:
        return
    try:
        loop = asyncio.get_running_loop()
        waits = []
        for fut in grammars.values():
            if not fut.done():
                woken = loop.create_future()
                fut.add_done_callback(lambda f, w=woken: _wake(loop, w))
                waits.append(woken)
        if waits:
            await asyncio.wait(waits, timeout=timeout)
        _outcome(grammars, timeout)
    finally:
        _release(grammars, backend)


def compiled_sync(reqs: list[Req], timeout: float, backend: Callable[[], Any]) -> None:
    """`compiled` for a blocking caller (interruptible)."""
    grammars = _grammars(reqs)
    if not grammars:
        return
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            _, late = concurrent.futures.wait(list(grammars.values()),
                                              timeout=min(wait_slice(), max(deadline - time.monotonic(), 0)))
            if not late:
                break
        _outcome(grammars, timeout)
    finally:
        _release(grammars, backend)


def _grammars(reqs: list[Req]) -> Grammars:
    return {r.grammar_key: r.grammar_future for r in reqs
            if r.grammar_future is not None and r.grammar_key is not None}


def _outcome(grammars: Grammars, timeout: float) -> None:
    """Raise what a compile raised (its ValueError), or the timeout's ValueError for one still running."""
    for (kind, _), fut in grammars.items():
        if not fut.done():
            raise ValueError(f"{kind}: the constraint did not compile within {timeout:g} s "
                             "(grammar_compile_timeout; sgnb serve --grammar-compile-timeout): fewer "
                             "properties, patterns or shorter repeats compile faster")
        fut.result()


def _release(grammars: Grammars, backend: Callable[[], Any]) -> None:
    for kind, source in grammars:
        backend().release(kind, source)


def _wake(loop: asyncio.AbstractEventLoop, fut: asyncio.Future) -> None:
    """Resolve an asyncio future from any thread (nothing when its loop closed meanwhile)."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(set_once, fut, None)
