"""Stop strings and stop regexes, matched against a request's growing output in bounded time.

A stop regex comes from a client, so it is matched with RE2 (google-re2): time linear in the text, whatever the
pattern (Python's backtracking `re` takes exponential time on `(.+)+X`, and the scheduler thread would hang on it).
RE2's syntax is Perl's without backreferences and lookaround; a pattern it cannot compile is refused when the
request is validated, naming the pattern.

Each step searches only the text a stop could newly end in: for strings, the new text plus the longest string's
length; for regexes, the new text plus the `REGEX_WINDOW` characters before it. A regex match is therefore found
when it spans at most `REGEX_WINDOW` characters (a stop pattern is a short marker in practice; an anchored `^...`
pattern matches only while the output is that short). No stop can be missed by a step and found by a later one.
"""

from __future__ import annotations

import functools
from typing import Any

REGEX_WINDOW = 4096  # characters before the new text in which a stop regex match may start
MAX_PATTERN_CHARS = 2048  # a longer stop regex is refused (RE2 bounds its program's memory too)
_MAX_MEM = 8 << 20  # bytes RE2 may use for one compiled pattern and its DFA cache


@functools.lru_cache(maxsize=512)
def compile_regex(pattern: str) -> Any:
    """The RE2 program of a stop regex; ValueError with RE2's reason when it cannot be matched in linear time
    (backreferences, lookaround) or is too large."""
    if len(pattern) > MAX_PATTERN_CHARS:
        raise ValueError(f"a stop regex may have at most {MAX_PATTERN_CHARS} characters, got {len(pattern)}")
    import re2

    options = re2.Options()
    options.log_errors = False
    options.max_mem = _MAX_MEM
    try:
        return re2.compile(pattern, options)
    except re2.error as e:
        reason = e.args[0].decode(errors="replace") if e.args and isinstance(e.args[0], bytes) else str(e)
        raise ValueError(f"invalid stop regex {pattern!r}: {reason} (stop regexes use RE2 syntax, matched in "
                         "linear time: no backreferences or lookaround)") from None


def regex_window_start(scanned: int) -> int:
    """Where a regex search starts when text[:scanned] was already searched without a match."""
    return max(scanned - REGEX_WINDOW, 0)


def search_regex(pattern: str, text: str, start: int) -> tuple[int, str] | None:
    """(position, matched text) of the leftmost match of `pattern` starting at or after `start`, else None.
    Costs O(len(text) - start): only that part is handed to RE2 (plus one character before it, so `^` and `\\b`
    see what precedes `start`)."""
    program = compile_regex(pattern)
    if start <= 0:
        m = program.search(text)
        return None if m is None else (m.start(), m.group(0))
    m = program.search(text[start - 1:], 1)
    return None if m is None else (start - 1 + m.start(), m.group(0))


def has_stop(text: str, stop: tuple[str, ...], stop_regex: tuple[str, ...], scanned: int) -> bool:
    """Whether a stop string or stop regex matches in `text`, given that text[:scanned] held none."""
    lo = max(scanned - max((len(x) for x in stop), default=1) + 1, 0)
    if any(text.find(x, lo) >= 0 for x in stop):
        return True
    start = regex_window_start(scanned)
    return any(search_regex(p, text, start) is not None for p in stop_regex)


def first_stop(text: str, stop: tuple[str, ...], stop_regex: tuple[str, ...],
               regex_start: int = 0) -> tuple[int, str] | None:
    """(position, matched text) of the earliest stop string in `text`, else of the first stop regex (in the
    order given) that matches at or after `regex_start`, else None."""
    hits = [(i, x) for i, x in ((text.find(x), x) for x in stop) if i >= 0]
    if hits:
        return min(hits)
    for pattern in stop_regex:
        hit = search_regex(pattern, text, regex_start)
        if hit is not None:
            return hit
    return None
