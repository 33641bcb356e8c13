"""The suite's cache-hit optimum (benchmarks/common.optimal_hit_rate) against a brute-force ideal cache."""

from __future__ import annotations

import sys
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from common import optimal_hit_rate  # noqa: E402


def ideal_cache_hit_rate(prompts: list[list[int]], last_token_computed: bool) -> float:
    """Prompts in order through an unbounded cache: each serves the longest prefix it shares with an earlier
    prompt; with last_token_computed, never its last token (an engine that needs that token's logits)."""
    hits = 0
    for i, p in enumerate(prompts):
        best = 0
        for q in prompts[:i]:
            n = 0
            while n < min(len(p), len(q)) and p[n] == q[n]:
                n += 1
            best = max(best, n)
        hits += min(best, len(p) - 1) if last_token_computed else best
    return hits / sum(len(p) for p in prompts)


@given(st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=6), min_size=1, max_size=8))
def test_optimal_hit_rate_is_the_ideal_caches_and_bounds_an_engines(prompts):
    opt = optimal_hit_rate(prompts)
    assert abs(opt - ideal_cache_hit_rate(prompts, last_token_computed=False)) < 1e-12
    assert ideal_cache_hit_rate(prompts, last_token_computed=True) <= opt + 1e-12


def test_repeated_prompts():
    assert optimal_hit_rate([[5, 6], [5, 6], [5, 6]]) == 4 / 6
    assert optimal_hit_rate([[1, 2, 3], [1, 2, 3, 4]]) == 3 / 7
    assert optimal_hit_rate([[1, 2, 3, 4], [1, 2, 3]]) == 3 / 7
