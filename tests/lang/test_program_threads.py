"""Program states run their nodes on a bounded thread pool: `fork(1000)` started 1,000 OS threads (issue 36). A
wide fork still runs every branch, in order within each branch, and a branch that waits for other states inside
a node (a nested fork's join) never starves the states it waits for."""

from __future__ import annotations

import threading
import time

import pytest

import sgnb as sgl
from sgnb import interpreter


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
