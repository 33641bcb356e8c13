"""Stop strings and stop regexes on a growing output (engine/stops.py): the incremental, windowed search finds
the same first stop as Python's `re` over the whole text, for patterns both engines read alike; and it takes time
linear in the new text whatever the pattern."""

from __future__ import annotations

import re
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sgnb.engine import stops

PATTERNS = [r"\d+\.", r"(.+)+X", r"\bend\b", r"^ab", r"a{2,3}b", r"(x|yz)+!", r"[A-Z][a-z]+ [A-Z]", r"\n\n",
            r"(?i)stop", r"Answer:\s*\w"]
# the oracle's spelling of a pattern: Python's backtracking `re` takes exponential time on (.+)+X over a line with no
# X (a hypothesis example of 180 such characters ran for hours), while .+X matches the same (from the leftmost start
# to the line's last X) in linear time; RE2, which the engine uses, reads both in linear time
ORACLE = {r"(.+)+X": r".+X"}


def _incremental(text_chunks: list[str], pattern: str) -> tuple[int, int, str] | None:
    """Feed chunks as a scheduler would; (chunk index, position, match) of the first stop, or None."""
    text, scanned = "", 0
    for i, chunk in enumerate(text_chunks):
        text += chunk
        if stops.has_stop(text, (), (pattern,), scanned):
            pos, matched = stops.first_stop(text, (), (pattern,), stops.regex_window_start(scanned))
            return i, pos, matched
        scanned = len(text)
    return None


@settings(max_examples=300, deadline=None)
@given(chunks=st.lists(st.text(alphabet="ab XyzAnd.!\n0123456789Sstop:", max_size=6), max_size=30),
       pattern=st.sampled_from(PATTERNS))
def test_incremental_search_finds_what_re_finds_over_the_whole_text(chunks, pattern):
    got = _incremental(chunks, pattern)
    text = ""
    for i, chunk in enumerate(chunks):
        text += chunk
        m = re.search(ORACLE.get(pattern, pattern), text)
        if m:
            assert got is not None and got[0] == i, (got, i)
            assert (got[1], got[2]) == (m.start(), m.group(0))
            return
    assert got is None


def test_a_match_is_found_across_chunk_boundaries_and_far_into_the_output():
    filler = "word " * 3000  # 15,000 characters: the regex window, not the whole output, is searched
    assert _incremental([filler, "Answer", ":", " ", "x"], r"Answer:\s*\w") == (4, len(filler), "Answer: x")
    assert _incremental([filler, "en", "d "], r"\bend\b") == (2, len(filler), "end")


def test_a_catastrophic_pattern_costs_linear_time():
    text = "a" * 50_000
    t0 = time.perf_counter()
    for end in range(100, len(text), 500):  # 100 steps over a growing output
        assert not stops.has_stop(text[:end], (), (r"(.+)+X",), max(end - 500, 0))
    assert time.perf_counter() - t0 < 5  # Python's re would not finish one step of these


@pytest.mark.parametrize("pattern", [r"(a)\1", "(?=a)", "(?<=a)b", "(?P<n>a)(?P=n)", "x" * (stops.MAX_PATTERN_CHARS + 1)])
def test_patterns_re2_cannot_match_in_linear_time_are_refused(pattern):
    from sgnb.engine.sampling_params import SamplingParams

    with pytest.raises(ValueError, match="stop_regex"):
        SamplingParams.from_dict({"stop_regex": pattern})
