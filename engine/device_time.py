"""DeviceTime: how long the device computed, against the wall: the instrument for "is the GPU waiting on Python?".

The scheduler wraps each piece of device work (a forward, a batch's sampling, prompt logprobs) in `span()`. On
CUDA a span is a pair of timing events recorded on the current stream around the launches; the pair is read once
the device has passed it (`Event.query()`, no synchronize), so measuring costs no stall. The device's time in a
span runs from its start event to its end event: the kernels queued in between plus any gap while the host was
still launching them (none inside a CUDA graph), so the sum is the device's busy time, slightly over. The time
between spans, when the device has nothing queued, is its idle time. On a CPU the work runs on the host: a span
is its wall time.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Any


class DeviceTime:
    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.seconds = 0.0  # device time of the spans read so far
        self.spans = 0
        self._pending: deque[tuple[Any, Any]] = deque()  # CUDA event pairs not yet passed by the device
        self._lock = threading.Lock()  # the scheduler thread adds spans, get_stats() reads from any thread

    @contextlib.contextmanager
    def span(self) -> Iterator[None]:
        if not self.cuda:
            t0 = time.perf_counter()
            yield
            with self._lock:
                self.seconds += time.perf_counter() - t0
                self.spans += 1
            return
        import torch

        start = torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._pending.append((start, end))
        if len(self._pending) > 64:
            self.collect()

    def collect(self) -> float:
        """Add the spans the device has passed; returns the device seconds so far."""
        with self._lock:
            while self._pending and self._pending[0][1].query():
                start, end = self._pending.popleft()
                self.seconds += start.elapsed_time(end) / 1000.0
                self.spans += 1
            return self.seconds
