"""EventBus: the engine's event stream (cache changes, request lifecycle) for views and tests.

Events are plain dicts: {"type", "seq", "t", ...}. Subscribers run on the scheduler thread, so they must be
quick (views buffer and throttle); an exception in a subscriber is logged and never reaches the engine.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

log = logging.getLogger("sgnb.engine")

Event = dict[str, Any]


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

    def emit(self, kind: str, data: dict[str, Any]) -> None:
        event = {"type": kind, "seq": next(self._seq), "t": time.time(), **data}
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
