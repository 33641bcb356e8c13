"""Ticker: the timer thread behind every view. Views never do work on the threads that feed them events
(executor threads, the engine's scheduler thread); they buffer, and a Ticker drains the buffer at <= 1/interval Hz.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("sgnb.widgets")

# Views of a batch of programs (the run_batch table, a ProgramView over run_batch) refresh at most this often, and
# their programs' gens stream at this pace: a GPU-speed batch of 64 programs whose threads woke 20 times a second
# each lost ~5% of its throughput to them (benchmarks/bench_views.py). A single program's view keeps 0.05 s.
BATCH_INTERVAL = 0.25


class Ticker:
    """Calls `tick()` on a daemon thread every `interval` seconds until `stop()`.

    `tick` returns True when it did work. With `idle_stop`, the thread ends after that many seconds without
    work and `start()` (cheap when running) brings it back, so a finished ProgramView holds no thread.

    The wait after a tick stretches so that the thread's CPU time stays under `max_share` of the time that
    passes, however slow a tick gets (a large tree): a tick holds the GIL, which a Python-bound engine's
    scheduler thread needs to launch every step, so a view can slow the engine by about that share at most.
    """

    max_share = 0.02  # of the process's time (in practice: of the GIL) one view's thread may take

    def __init__(self, tick: Callable[[], bool], interval: float, name: str,
                 idle_stop: float | None = None) -> None:
        self.tick = tick
        self.interval = interval
        self.name = name
        self.idle_stop = idle_stop
        self.ticks = 0
        self.cpu_seconds = 0.0  # CPU time the thread spent in tick(): what a view takes from its process
        self.wall_seconds = 0.0  # wall time in tick(), waits for the GIL included
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()
        self._poked = False

    def start(self) -> None:
        """Run the thread (again); safe from any thread, and cheap when it already runs."""
        with self._lock:
            self._poked = True
            if self._thread is None and not self._stopped.is_set():
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2)

    @property
    def running(self) -> bool:
        return self._thread is not None

    def _run(self) -> None:
        wait, last_work = self.interval, time.monotonic()
        while not self._stopped.wait(wait):
            t0, c0 = time.monotonic(), time.thread_time()
            try:
                worked = bool(self.tick())
            except Exception:  # a broken view must not die silently nor take its feeder with it
                log.exception("%s: tick failed", self.name)
                worked = False
            now, cpu = time.monotonic(), time.thread_time() - c0
            self.cpu_seconds += cpu
            self.wall_seconds += now - t0
            self.ticks += 1
            wait = max(self.interval, cpu * (1 / self.max_share - 1))
            if worked:
                last_work = now
                continue
            with self._lock:
                if self._poked:
                    self._poked, last_work = False, now
                elif self.idle_stop is not None and now - last_work > self.idle_stop:
                    self._thread = None
                    return
