"""EngineConfig.follow_up_wait_s (experimental, off by default): the callers of a batch's requests are told once the
whole batch is read, and after telling callers whose requests ended the scheduler waits a bounded moment for their
next requests before it admits. Results must be those of the default scheduler; a caller told must find every other
request its batch ended already ended (that is the point: no woken thread runs while the batch's bookkeeping is
half done); without the flag a caller is told as its own request ends."""

from __future__ import annotations

import threading

import pytest
from engine_checks import assert_pool_consistent

PROMPTS = [f"List {i}: apples, pears, plums and" for i in range(6)]


@pytest.fixture(scope="module")
def engines():
    from sgnb.engine import Engine

    common = dict(quantization="none")
    waiting = Engine("smollm2", follow_up_wait_s=0.02, **common)
    plain = Engine("smollm2", **common)
    yield waiting, plain
    waiting.shutdown()
    plain.shutdown()


def _finished_seen_by_each_callback(engine) -> list[int]:
    """Submit six one-token requests in one batch; each on_update callback records how many of the six had
    ended when it ran (on the scheduler thread)."""
    from sgnb.engine.request import Req
    from sgnb.engine.sampling_params import SamplingParams

    engine.flush_cache()
    sp = SamplingParams.from_dict({"max_new_tokens": 1, "temperature": 0})
    seen: list[int] = []
    done = threading.Event()
    reqs: list[Req] = []

    def on_update(r: Req) -> None:
        seen.append(sum(x.finished for x in reqs))
        if len(seen) == len(reqs):
            done.set()

    reqs.extend(Req(f"told-{i}-{id(engine)}", engine.tokenizer.encode(p), sp, on_update=on_update)
                for i, p in enumerate(PROMPTS))
    engine.scheduler.submit(*reqs)
    assert done.wait(60), "the callers were not all told"
    return seen


def test_callers_are_told_after_the_whole_batch_is_read(engines):
    waiting, plain = engines
    assert _finished_seen_by_each_callback(waiting) == [len(PROMPTS)] * len(PROMPTS)
    # the default tells each caller as its request ends: the first finds the others still running
    assert _finished_seen_by_each_callback(plain)[0] < len(PROMPTS)
    assert_pool_consistent(waiting)
    assert_pool_consistent(plain)


def test_results_match_the_default_scheduler_under_concurrent_programs(engines):
    """Threads that each send dependent requests (the next prompt holds the last answer), as programs do: the
    same greedy tokens and cached-token counts with and without the wait, and the wait happened."""
    waiting, plain = engines

    def chains(engine) -> list[list[list[int]]]:
        engine.flush_cache()
        out: list[list[list[int]]] = [[] for _ in PROMPTS]

        def run(i: int) -> None:
            text = PROMPTS[i]
            for _ in range(3):
                r = engine.generate(text, {"max_new_tokens": 4, "temperature": 0})
                out[i].append(r["output_ids"])
                text += r["text"]

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        return out

    before = waiting.get_stats()["follow_up_waits"]
    assert chains(waiting) == chains(plain)
    assert waiting.get_stats()["follow_up_waits"] > before
    assert plain.get_stats()["follow_up_waits"] == 0
    assert_pool_consistent(waiting)


@pytest.mark.parametrize("bad", [-0.01, 2.0, True, "0.02"])
def test_a_bad_wait_is_refused_at_the_config(bad):
    from sgnb.engine.config import EngineConfig

    with pytest.raises(ValueError, match="follow_up_wait_s"):
        EngineConfig(follow_up_wait_s=bad)
