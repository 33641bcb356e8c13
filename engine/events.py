"""EventBus: the engine's event stream (cache changes, request lifecycle) for views and tests.

Events are plain dicts: {"type", "seq", "t", ...}, one TypedDict per kind below. Subscribers run on the scheduler
thread, so they must be quick (views buffer and throttle); an exception in a subscriber is logged and never reaches
the engine. `seq` counts up by one per event (a gap: events were missed), `t` is time.time() at the emit.

| type | emitted by | what |
|---|---|---|
| reset | RadixCache.reset | a new empty tree (start, flush_cache): its `root` |
| insert | RadixCache.insert | a new leaf `node` under `parent` with `tokens` of request `rid` |
| split | RadixCache (a match or insert inside a node) | `node`'s first `at` tokens became the new node `upper` |
| lock / unlock | RadixCache.inc_lock_ref / dec_lock_ref | `nodes` became in use by a request / free to evict |
| hit | RadixCache.record_hit | request `rid` matched `nodes`, `tokens` in all |
| evict | RadixCache.evict | `nodes` left the tree, freeing `tokens` KV slots |
| request | Scheduler (queued), finishing (finished), decode (retracted) | request `rid`'s `state` changed |

Consumers: sgnb.widgets.RadixTreeView (every kind: a mirror of the tree), the benchmarks' optimal-hit count
(benchmarks/bench_suite.py: queued requests' input_ids) and tests. The lab panel and the server read snapshots.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Literal, TypedDict, cast

log = logging.getLogger("sgnb.engine")


# ---- what each kind carries besides type, seq and t (what emitters pass to `emit`) ----------------------------------
class ResetData(TypedDict):
    root: int  # the new root's node id


class InsertData(TypedDict):
    node: int  # the new leaf's id
    parent: int  # the node it hangs under
    tokens: int  # its key's length
    rid: str | None  # the request whose tokens they are (None: a cache_prefix without one)


class SplitData(TypedDict):
    node: int  # the node that was cut (it keeps its id and its tail)
    upper: int  # the new node above it, holding its first `at` tokens
    parent: int  # the node above `upper`
    at: int  # tokens that went to `upper`


class NodesData(TypedDict):
    nodes: list[int]  # lock / unlock: the nodes whose lock count left / reached zero


class HitData(TypedDict):
    nodes: list[int]  # the matched nodes, root side first
    tokens: int  # the tokens they hold
    rid: str | None  # the request that matched them


class EvictData(TypedDict):
    nodes: list[int]  # the evicted nodes
    tokens: int  # the KV slots freed


class _RequestData(TypedDict):
    rid: str
    state: Literal["queued", "finished", "retracted"]


class RequestData(_RequestData, total=False):
    prompt_tokens: int  # queued: the prompt's tokens
    input_ids: list[int]  # queued: the prompt's token ids (the request's own list, not a copy)
    reason: str  # finished: its finish_reason's type ("stop", "length", "abort")
    completion_tokens: int  # finished: the tokens it generated


EventData = ResetData | InsertData | SplitData | NodesData | HitData | EvictData | RequestData
EventKind = Literal["reset", "insert", "split", "lock", "unlock", "hit", "evict", "request"]


# ---- the events as subscribers get them -----------------------------------------------------------------------------
class _Stamp(TypedDict):
    seq: int  # the event's number: one more than the last one's
    t: float  # time.time() when it was emitted


class ResetEvent(_Stamp, ResetData):
    type: Literal["reset"]


class InsertEvent(_Stamp, InsertData):
    type: Literal["insert"]


class SplitEvent(_Stamp, SplitData):
    type: Literal["split"]


class LockEvent(_Stamp, NodesData):
    type: Literal["lock", "unlock"]


class HitEvent(_Stamp, HitData):
    type: Literal["hit"]


class EvictEvent(_Stamp, EvictData):
    type: Literal["evict"]


class RequestEvent(_Stamp, RequestData):
    type: Literal["request"]


Event = ResetEvent | InsertEvent | SplitEvent | LockEvent | HitEvent | EvictEvent | RequestEvent
EventSink = Callable[[EventKind, EventData], None]  # what emits: `EventBus.emit`, or a test's recorder

# each kind's record (the test of the emitted events reads it)
EVENT_TYPES: dict[str, Any] = {"reset": ResetEvent, "insert": InsertEvent, "split": SplitEvent, "lock": LockEvent,
                               "unlock": LockEvent, "hit": HitEvent, "evict": EvictEvent, "request": RequestEvent}


def wait_slice() -> float:
    """How long a caller's thread blocks waiting on the engine before it looks again (for an interrupt, a closed
    engine, a failed program): 0.1 s in the main thread, where KeyboardInterrupt lands; 1 s in other threads.
    (run_batch's 64 programs had 128 threads waking ten times a second: a third of the samples in which their
    threads held the GIL, which the scheduler thread needs too.)"""
    return 0.1 if threading.current_thread() is threading.main_thread() else 1.0


class EventBus:
    def __init__(self, history: int = 10_000) -> None:
        self._subscribers: list[Callable[[Event], None]] = []
        self._history: deque[Event] = deque(maxlen=history)
        self._seq = itertools.count()
        self._lock = threading.Lock()

    def emit(self, kind: EventKind, data: EventData) -> None:
        event = cast(Event, {"type": kind, "seq": next(self._seq), "t": time.time(), **data})
        with self._lock:
            self._history.append(event)
            subscribers = list(self._subscribers)
        for callback in subscribers:
            try:
                callback(event)
            except Exception:  # a broken view must not break the engine
                log.exception("event subscriber %r failed", callback)

    def subscribe(self, callback: Callable[[Event], None], replay: bool = False) -> Callable[[], None]:
        """Call `callback(event)` for every later event (and the kept history first if replay). Returns an
        unsubscribe function."""
        with self._lock:
            past = list(self._history) if replay else []
            self._subscribers.append(callback)
        for event in past:
            callback(event)

        def unsubscribe() -> None:
            with self._lock:
                if callback in self._subscribers:
                    self._subscribers.remove(callback)

        return unsubscribe

    def clear(self) -> None:
        """Forget the kept history (subscribers stay)."""
        with self._lock:
            self._history.clear()

    def history(self) -> list[Event]:
        with self._lock:
            return list(self._history)
