"""A bounded, seeded fuzz of Engine.generate (issue 14): random keyword arguments and sampling parameters of every
JSON type. Each call either returns results or raises TypeError / ValueError before any model work; afterwards
the engine is alive, no KV slot leaked or stays locked, and a fixed greedy prompt gives the same tokens."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

PROMPT = "The capital of France is"
SAMPLING = ["max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k", "min_p", "frequency_penalty",
            "presence_penalty", "repetition_penalty", "stop", "stop_token_ids", "stop_regex", "ignore_eos", "n",
            "seed", "regex", "json_schema", "skip_special_tokens", "no_stop_trim", "max_tokens"]
scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 70), st.integers(-2**62, 2**62),
                    st.floats(allow_nan=True, allow_infinity=True, width=32), st.text(max_size=10),
                    st.sampled_from(["", "\n", "[a-z]+", "(", "{}", '{"type": "object"}', "Paris"]))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                        st.dictionaries(st.text(max_size=5), inner, max_size=2)),
                      max_leaves=5)
kwargs = st.fixed_dictionaries({}, optional={
    "sampling_params": st.dictionaries(st.sampled_from(SAMPLING), values, max_size=4),
    "return_logprob": values, "logprob_start_len": values, "top_logprobs_num": values, "rid": values,
    "input_ids": st.one_of(values, st.lists(st.integers(-3, 60000), min_size=1, max_size=6)),
})


def _cap(sp: dict) -> None:
    for key, cap in (("max_new_tokens", 3), ("max_tokens", 3), ("n", 2), ("min_new_tokens", 2)):
        if isinstance(sp.get(key), int) and not isinstance(sp.get(key), bool) and sp[key] > cap:
            sp[key] = cap
    sp.setdefault("max_new_tokens", 2)


def _cheap(kw: dict) -> dict:
    """The example with its lengths capped: a call that leaves max_new_tokens to the default (absent sampling
    params, or one dict per prompt in a list) decodes the default's 128 tokens, most of the fuzz's time when it
    was left so; the default itself is called once, apart."""
    sp = kw.setdefault("sampling_params", {})
    for one in sp if isinstance(sp, list) else [sp]:
        if isinstance(one, dict):
            _cap(one)
    if "input_ids" in kw:
        kw["prompt"] = None
    return kw


def test_fuzzed_generate_calls_fail_cleanly_or_succeed(engine):
    greedy = {"max_new_tokens": 6, "temperature": 0}
    before = engine.generate(PROMPT, greedy)["output_ids"]
    assert engine.generate(PROMPT)["meta_info"]["completion_tokens"] > 0  # no sampling params: the defaults
    outcomes = {"ok": 0, "refused": 0}

    @settings(max_examples=200, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(kwargs)
    def check(kw):
        try:
            engine.generate(**{"prompt": PROMPT, **_cheap(kw)})
            outcomes["ok"] += 1
        except (TypeError, ValueError):
            outcomes["refused"] += 1

    check()
    deadline = time.time() + 30
    while engine.scheduler.busy and time.time() < deadline:
        time.sleep(0.05)
    assert engine.scheduler.fatal is None
    assert engine.tree.protected_size == 0
    pool = engine.runner.kv_pool
    assert pool.available + engine.tree.total_size == pool.size
    assert engine.generate(PROMPT, greedy)["output_ids"] == before
    print("fuzzed generate calls:", outcomes)
    assert outcomes["ok"] > 0 and outcomes["refused"] > 0, outcomes
