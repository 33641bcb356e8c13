"""Program states run their nodes on a bounded thread pool: `fork(1000)` started 1,000 OS threads (issue 36). A
wide fork still runs every branch, in order within each branch, and a branch that waits for other states inside
a node (a nested fork's join) never starves the states it waits for."""

from __future__ import annotations

import threading
import time

import pytest

import sgnb as sgl
from sgnb import interpreter

ENGINE = "default"  # its assertions hold for any model: the quantized engine (tests/conftest.py)


@pytest.fixture(scope="module")
def backend(engine):
    return sgl.Runtime(engine=engine)


def _peak_threads(run) -> tuple[int, object]:
    """Run `run()` while sampling the process's thread count; (the peak above the count before, its result)."""
    base, peak, done = threading.active_count(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], threading.active_count())
            time.sleep(0.002)

    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    try:
        out = run()
    finally:
        done.set()
        watcher.join()
    return peak[0] - base, out


@sgl.function
def wide(s, width):
    s += "Count:"
    forks = s.fork(width)
    for i, f in enumerate(forks):
        f += f" {i}"
        f += sgl.gen("next", max_tokens=1, temperature=0)
        f += " done"
    forks.join()
    s += " end"


def test_a_fork_of_1000_does_not_start_1000_threads(backend):
    grew, state = _peak_threads(lambda: wide.run(width=1000, backend=backend))
    assert state.text().endswith(" end"), state.error()
    assert grew <= interpreter.PROGRAM_THREADS + 8, f"{grew} threads for fork(1000)"


@sgl.function
def nested(s):
    s += "Outer:"
    outer = s.fork(4)
    for i, f in enumerate(outer):
        f += f" <{i}"
        inner = f.fork(3)
        for j, g in enumerate(inner):
            g += f" {i}.{j}" + sgl.gen("x", max_tokens=1, temperature=0)
        inner.join("concate_and_append")  # a node of f that waits, on a pool thread, for f's own branches
        f += ">"
    outer.join("concate_and_append")


def test_waiting_branches_do_not_starve_the_states_they_wait_for(backend, monkeypatch):
    pool = interpreter._ProgramPool(2)  # fewer threads than the states that wait at once
    monkeypatch.setattr(interpreter, "_POOL", pool)
    state = nested.run(backend=backend)
    text = state.text()
    assert state.error() is None, state.error()
    assert all(f" <{i}" in text and f" {i}.2" in text for i in range(4)) and text.count(">") == 4, text


def test_executors_scheduled_while_a_thread_idles_all_run_at_once():
    """Three executors scheduled back to back while one pool thread idles: each gets a thread (the idle one
    takes one, new threads the others), so three long gens (fork branches) decode together instead of in turn."""
    pool = interpreter._ProgramPool(8)
    started, release = threading.Barrier(4, timeout=10), threading.Event()

    class Node:  # stands for an executor whose queue holds one long node
        def __init__(self, barrier: threading.Barrier | None) -> None:
            self.barrier = barrier

        def _drain(self) -> None:
            if self.barrier is not None:
                self.barrier.wait()  # raises BrokenBarrierError unless all three run at the same time
                release.wait(10)

    pool.schedule(Node(None))  # one thread, idle once this ends
    deadline = time.monotonic() + 5
    while pool._idle != 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool._idle == 1 and pool.threads == 1
    for _ in range(3):
        pool.schedule(Node(started))
    started.wait()  # the three nodes are running at once
    release.set()
    assert pool.threads == 3


def test_the_pool_can_keep_a_full_engine_batch_of_gens_in_flight():
    """A gen holds its pool thread while it waits, so fewer threads than the engine's running batch would cap how
    many of a program's branches decode together (tree_of_thought at GPU scale ran its leaves in 8 rounds)."""
    from sgnb.engine.config import EngineConfig

    assert interpreter.PROGRAM_THREADS >= EngineConfig.max_running_requests
