"""Grammar: structured output (regex, JSON schema, EBNF) over xgrammar, with jump-forward decoding.

One GrammarBackend per engine: it validates constraints at submission, compiles them (cached by source,
deduplicated, on a small thread pool off the scheduler's critical path) and makes a GrammarMatcher per request.
Each step the scheduler fills one bitmask row per constrained request and applies it to the logits before
sampling; after sampling it feeds the token to the matcher. When the grammar then admits exactly one
continuation (the compressed FSM has a single path), `jump_forward` turns that string into the tokenizer's
canonical tokens, which the engine appends with one prefill instead of decoding them one by one.

Token bytes: xgrammar sees each id as raw bytes (`TokenizerInfo.decoded_vocab`); added and special tokens are
blanked, which makes xgrammar treat them as special and mask them everywhere (otherwise SmolLM2's
`<repo_name>` & co. could appear inside a constrained string). Ids past the tokenizer (a model whose embedding
has more rows) are blank too, so they are masked.
"""

from __future__ import annotations

import bisect
import functools
import json
import math
import os
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal, NamedTuple

import numpy as np
import torch
import xgrammar as xgr
from xgrammar import CompiledGrammar

from sgnb.engine.sampling_params import SamplingParams, check_constraint_size
from sgnb.engine.tokenizer import Tokenizer

__all__ = [
    "CompileCancelled", "CompiledGrammar", "GrammarBackend", "GrammarMatcher", "JumpForward", "allocate_bitmask", "apply_bitmask",
    "apply_bitmask_torch", "apply_bitmask_xgrammar", "constraint_of", "flatten_bounded_repeats", "jump_forward",
    "validate_constraint",
]

Kind = Literal["regex", "json_schema", "ebnf"]
KINDS: tuple[str, ...] = ("regex", "json_schema", "ebnf")
DEFAULT_MAX_SOURCE_BYTES = 64 << 10  # a constraint's source (EngineConfig.max_grammar_bytes)
MAX_EXTENDERS_CHECKED = 32  # beyond this many grammar-allowed extenders, assume the last forced token may merge


def constraint_of(sp: SamplingParams) -> tuple[Kind, str] | None:
    """The (kind, source) of a request's constraint, or None when it has none (SamplingParams allows one)."""
    for kind in KINDS:
        source = getattr(sp, kind)
        if source is not None:
            return kind, source  # type: ignore[return-value]
    return None


# ---- backend ---------------------------------------------------------------------------------------------------
class GrammarBackend:
    """Compiles constraints for one tokenizer and model vocabulary.

    `vocab_size` is the model's (its logits width); it may exceed the tokenizer's, the extra ids are masked.
    Thread-safe: validate/compile/compile_async may be called from any thread. A compiled grammar is shared by
    all matchers made from it (it is immutable); a GrammarMatcher is not thread-safe.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, *, max_workers: int = 2,
                 mask_threads: int | None = None, json_any_whitespace: bool = True,
                 cache_limit_bytes: int = 256 << 20, max_source_bytes: int = DEFAULT_MAX_SOURCE_BYTES) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.json_any_whitespace = json_any_whitespace
        self.cache_limit_bytes = cache_limit_bytes
        self.max_source_bytes = max_source_bytes
        self.info, token_bytes = _tokenizer_info(tokenizer, vocab_size)
        # a step's masks, filled by xgrammar's C++ threads: half the machine's CPUs, 2 to 8 (a GPU step is
        # short, and a batch of 64 masks of a loose regex took ~45 ms on 2 threads: the JSON workloads'
        # rounds waited on it; xgrammar's own default is also half the hardware threads). One compile uses as
        # many (a written-out bounded repeat, below, costs the compile what it saves the masks).
        self._mask_threads = mask_threads or max(2, min(8, (os.cpu_count() or 2) // 2))
        # our cache (below) dedups in-flight compiles and counts them; xgrammar's own would hold a second copy
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=max(max_workers, self._mask_threads),
                                            cache_enabled=False)
        self.vocab = TokenVocab(token_bytes)
        self.compile_count = 0  # compiles actually run (cache misses)
        self.cancelled_count = 0  # compiles dropped before they started: nobody waited for them any more
        self._max_workers = max_workers
        # two lanes: small grammars never queue behind big ones (see _is_big), each lane has its own workers
        self._pools: dict[bool, ThreadPoolExecutor] = {}
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()  # LRU, newest last
        self._waiters: dict[tuple[str, str], int] = {}  # requests waiting for a compile that is not done
        self._big: OrderedDict[tuple[str, str], bool] = OrderedDict()  # each validated source's lane
        self._batch_filler: xgr.BatchGrammarMatcher | None = None

    # ---- validation and compilation ----------------------------------------------------------------------
    def validate(self, kind: str, source: str) -> None:
        """Raise ValueError (with the parser's message) when `source` is not a valid `kind` constraint, or when
        it is longer than max_source_bytes.

        Parses only (milliseconds for typical constraints); the token-level compile happens in compile(). The
        parsed grammar's size decides which lane compiles it (see _is_big).
        """
        _check_kind(kind, source)
        check_constraint_size(kind, source, self.max_source_bytes)
        grammar = validate_constraint(kind, source, self.json_any_whitespace)
        big = _is_big(grammar)
        with self._lock:
            self._big[(kind, source)] = big
            while len(self._big) > 4096:
                self._big.popitem(last=False)

    def compile(self, kind: str, source: str) -> CompiledGrammar:
        """The compiled grammar for (kind, source), from the cache when present. Raises ValueError if invalid."""
        fut = self.compile_async(kind, source)
        try:
            return fut.result()
        finally:
            self.release(kind, source)

    def compile_async(self, kind: str, source: str) -> Future:
        """A Future of compile(kind, source), compiled on the backend's thread pool. The caller waits for it
        until it is done or it gives up, then calls release(kind, source): a compile nobody waits for any more
        is dropped before it starts (its Future fails with CompileCancelled), never cached.

        Identical constraints share one Future: a batch of n equal requests compiles once. A failed compile
        (ValueError in the Future) is not cached. Grammars validate() found big compile on their own workers,
        so a small or cached grammar never waits behind a big one.
        """
        _check_kind(kind, source)
        key = (kind, source)
        with self._lock:
            fut = self._cache.get(key)
            # a failed Future may still be here: its waiters wake before the callback that drops it runs
            if fut is not None and not (fut.done() and fut.exception() is not None):
                self._cache.move_to_end(key)
                if not fut.done():
                    self._waiters[key] = self._waiters.get(key, 0) + 1
                return fut
            big = self._big.get(key, True)  # never validated here: assume the worst
            pool = self._pools.get(big)
            if pool is None:
                pool = self._pools[big] = ThreadPoolExecutor(
                    self._max_workers, thread_name_prefix="sgnb-grammar-big" if big else "sgnb-grammar")
            self.compile_count += 1
            self._waiters[key] = self._waiters.get(key, 0) + 1
            fut = pool.submit(self._compile_wanted, kind, source)
            self._cache[key] = fut
        fut.add_done_callback(functools.partial(self._settle, key))
        return fut

    def release(self, kind: str, source: str) -> None:
        """One waiter of compile_async(kind, source) stopped waiting (its compile ended, or it gave up)."""
        key = (kind, source)
        with self._lock:
            left = self._waiters.get(key, 0) - 1
            if left > 0:
                self._waiters[key] = left
            else:
                self._waiters.pop(key, None)

    def _compile_wanted(self, kind: str, source: str) -> CompiledGrammar:
        with self._lock:
            wanted = self._waiters.get((kind, source), 0) > 0
            if not wanted:
                self.cancelled_count += 1
        if not wanted:  # its requests left (aborted, timed out) while it queued: compile nothing
            raise CompileCancelled(f"the {kind} compile was cancelled: no request waits for it")
        return self._compile_now(kind, source)

    def _compile_now(self, kind: str, source: str) -> CompiledGrammar:
        try:
            if kind == "regex":
                flat = flatten_bounded_repeats(source)
                if flat != source:
                    try:
                        return self.compiler.compile_regex(flat)
                    except Exception:  # the rewrite is ours: the user's text decides (and words any error)
                        pass
                return self.compiler.compile_regex(source)
            if kind == "json_schema":
                return self.compiler.compile_json_schema(_schema_text(source),
                                                         any_whitespace=self.json_any_whitespace)
            return self.compiler.compile_grammar(source)
        except ValueError:
            raise
        except Exception as e:
            raise ValueError(f"invalid {kind}: {_parser_message(e)}") from None

    def _settle(self, key: tuple[str, str], fut: Future) -> None:
        """Drop failed compiles; evict least recently used grammars past the byte limit."""
        with self._lock:
            if self._cache.get(key) is fut:
                self._waiters.pop(key, None)  # done: nobody waits for it any more
            if fut.exception() is not None:
                if self._cache.get(key) is fut:
                    del self._cache[key]
                return
            done = [(k, f) for k, f in self._cache.items() if f.done() and f.exception() is None]
            total = sum(f.result().memory_size_bytes for _, f in done)
            for k, f in done:  # oldest first; never the grammar just compiled
                if total <= self.cache_limit_bytes:
                    break
                if k == key:
                    continue
                total -= f.result().memory_size_bytes
                del self._cache[k]

    def close(self) -> None:
        """Stop the compile threads (pending compiles finish first)."""
        for pool in self._pools.values():
            pool.shutdown(wait=True)
        self._pools = {}

    # ---- matching ----------------------------------------------------------------------------------------
    def matcher(self, compiled: CompiledGrammar) -> GrammarMatcher:
        """A fresh matcher (start state) for one request."""
        return GrammarMatcher(compiled, self.vocab)

    def allocate_bitmask(self, batch: int) -> torch.Tensor:
        return allocate_bitmask(batch, self.vocab_size)

    def fill_bitmasks(self, matchers: list[GrammarMatcher], bitmask: torch.Tensor, rows: list[int]) -> None:
        """Fill bitmask[rows[i]] for matchers[i], in parallel in C++ threads (one call per step)."""
        assert len(matchers) == len(rows)
        if len(matchers) == 1:
            matchers[0].fill_bitmask(bitmask, rows[0])
            return
        if self._batch_filler is None:
            self._batch_filler = xgr.BatchGrammarMatcher(max_threads=self._mask_threads)
        self._batch_filler.batch_fill_next_token_bitmask([m._m for m in matchers], bitmask, rows)


def _tokenizer_info(tokenizer: Tokenizer, vocab_size: int) -> tuple[xgr.TokenizerInfo, list[bytes]]:
    """xgrammar's view of the vocabulary (encoded token strings, added/special tokens blanked so they are masked)
    and each id's bytes (b'' for the blanked ids and for ids past the tokenizer)."""
    backend = tokenizer.backend
    vocab = [""] * min(tokenizer.vocab_size, vocab_size)
    for token, i in backend.get_vocab(with_added_tokens=True).items():
        if i < len(vocab):
            vocab[i] = token
    for i in set(backend.get_added_tokens_decoder()) | set(tokenizer.special_token_ids):
        if i < len(vocab):
            vocab[i] = ""
    vocab_type, prefix_space = _vocab_type(json.loads(backend.to_str()))
    stop = [i for i in tokenizer.eos_token_ids if i < vocab_size]
    if not stop:
        raise ValueError("structured output needs a stop token: the tokenizer has no eos_token_id in the vocabulary")
    info = xgr.TokenizerInfo(vocab, vocab_type, vocab_size=vocab_size, stop_token_ids=stop,
                             add_prefix_space=prefix_space)
    # info.decoded_vocab holds the same bytes but crosses the FFI one token at a time (~0.5 s for 49k tokens)
    token_bytes = [_token_bytes(t, vocab_type) for t in vocab] + [b""] * (vocab_size - len(vocab))
    return info, token_bytes


def _vocab_type(spec: dict[str, Any]) -> tuple[xgr.VocabType, bool]:
    """How a tokenizer.json spells token bytes: byte-level (GPT-2 'Ġ'), byte-fallback ('▁', '<0x0A>') or raw;
    and whether encoding prepends a space (sentencepiece's '▁' prefix)."""
    def types(node: Any) -> list[str]:
        if not isinstance(node, dict):
            return []
        inner = node.get("decoders") or node.get("pretokenizers") or node.get("normalizers") or []
        return [node.get("type", "")] + [t for n in inner for t in types(n)]

    decoders = types(spec.get("decoder"))
    if "ByteLevel" in decoders:
        return xgr.VocabType.BYTE_LEVEL, False
    if "ByteFallback" in decoders or spec.get("model", {}).get("byte_fallback"):
        normalizers, pre = types(spec.get("normalizer")), spec.get("pre_tokenizer") or {}
        prefix = "Prepend" in normalizers or (pre.get("type") == "Metaspace"
                                              and pre.get("prepend_scheme", "always") != "never")
        return xgr.VocabType.BYTE_FALLBACK, prefix
    return xgr.VocabType.RAW, False


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: printable Latin-1 bytes stand for themselves, the other bytes are
    spelled with the code points from U+0100 up, in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    shifted = [b for b in range(256) if b not in set(printable)]
    return {chr(b): b for b in printable} | {chr(0x100 + n): b for n, b in enumerate(shifted)}


_BYTE_LEVEL = _byte_level_decoder()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _token_bytes(token: str, vocab_type: xgr.VocabType) -> bytes:
    if vocab_type == xgr.VocabType.BYTE_LEVEL:
        try:
            return bytes(_BYTE_LEVEL[c] for c in token)
        except KeyError:  # not in the byte alphabet (some added tokens): the text itself
            return token.encode("utf-8")
    if vocab_type == xgr.VocabType.BYTE_FALLBACK:
        m = _BYTE_FALLBACK.fullmatch(token)
        return bytes([int(m.group(1), 16)]) if m else token.replace("\u2581", " ").encode("utf-8")
    return token.encode("utf-8")


def validate_constraint(kind: str, source: str, json_any_whitespace: bool = True) -> xgr.Grammar:
    """Parse a constraint without any tokenizer: its grammar, or ValueError with the parser's message when it is
    invalid. The language calls this at the gen() line, the engine at submission: a source is parsed once (the
    last 128 valid ones are kept; a typical parse takes 5-50 us, a schema nested 200 deep a second)."""
    _check_kind(kind, source)
    return _parse(kind, source, json_any_whitespace)


@functools.lru_cache(maxsize=128)  # valid sources only: a parse that raises is not cached
def _parse(kind: str, source: str, json_any_whitespace: bool) -> xgr.Grammar:
    try:
        if kind == "regex":
            return xgr.Grammar.from_regex(source)
        if kind == "json_schema":
            return xgr.Grammar.from_json_schema(_schema_text(source), any_whitespace=json_any_whitespace)
        return xgr.Grammar.from_ebnf(source)
    except ValueError:
        raise
    except Exception as e:  # xgrammar raises RuntimeError from its C++ parsers
        raise ValueError(f"invalid {kind}: {_parser_message(e)}") from None


class CompileCancelled(Exception):
    """A compile dropped before it started: every request that wanted it had gone."""


# ---- compile lanes -------------------------------------------------------------------------------------------
# A compile's time grows with the grammar's rules and with its bounded repeats, which xgrammar writes out as
# nested rules: on this machine `[0-9]{3}` compiles in 1 ms, `[a-z]{1,2000}` (13 bytes) in 0.7 s, a JSON schema of
# 100 properties with a `pattern` each in 1.5 s, 2,000 of them in ~20 s. A grammar whose printed EBNF is long or
# holds a repeat past BIG_REPEAT compiles in the "big" lane, with its own workers: what the parse shows is enough
# to keep every small grammar out of a big one's queue, and a big one is bounded by max_grammar_bytes and by the
# time the engine lets a request wait for it (grammar_compile_timeout).
BIG_GRAMMAR_CHARS = 4000
BIG_REPEAT = 64
_REPEAT = re.compile(r"\{(\d+)(?:,\s*(\d*))?\}")


def _is_big(grammar: xgr.Grammar) -> bool:
    text = str(grammar)
    if len(text) > BIG_GRAMMAR_CHARS:
        return True
    return any(int(hi or lo) > BIG_REPEAT for lo, hi in _REPEAT.findall(text))


# ---- bounded repeats ---------------------------------------------------------------------------------------
# xgrammar expands a bounded repeat of one character (`[\w ]{1,16}`) into a chain of nested optional rules; a
# mask inside the chain checks every token that could end it through the nesting, 2-4 ms a mask on this
# machine's CPU for a word-character class and SmolLM2's vocabulary (the JSON workloads' rounds waited on it).
# The same language as flat alternations of sequences (`C(?:C{4}|C{8}|C{12})?(?:C|CC|CCC)?` for {1,16}) masks
# in ~0.03 ms: every position is a plain element of a sequence, whose tokens xgrammar classifies when compiling.
# The compile grows with the elements written out (31 for {1,16}: +50 ms on this machine; 60 for {0,24}:
# +160 ms; 253 for {1,64}: +0.9 s against ~27 ms of masks saved per pass through the field), so only repeats up
# to FLATTEN_MAX_ELEMENTS are rewritten, and only where the repeated atom is a single character (a class, an
# escape like \w, `.` or a literal): a quantified group, a backreference or syntax the scanner does not know
# leaves the regex as the user wrote it.
FLATTEN_MAX_ELEMENTS = 64
_QUANT = re.compile(r"\{(\d+)(,(\d*))?\}")
_ANCHOR_ESCAPES = set("bBAZzG")


class _Unsupported(Exception):
    pass


def flatten_bounded_repeats(regex: str, max_elements: int = FLATTEN_MAX_ELEMENTS) -> str:
    """`regex` with each bounded repeat of a single-character atom written out as a flat alternation (the same
    language; see above). Returns `regex` itself when there is nothing to rewrite or anything is unfamiliar."""
    if "{" not in regex:
        return regex
    try:
        return _flatten(regex, max_elements)
    except _Unsupported:
        return regex


def _flatten(s: str, max_elements: int) -> str:
    out: list[str] = []
    atom: int | None = None  # index in `out` of the last single-character atom, None after anything else
    i, n = 0, len(s)
    while i < n:
        c = s[i]
        if c == "\\":
            j = _escape_end(s, i)
            out.append(s[i:j])
            atom = len(out) - 1 if s[i + 1] not in _ANCHOR_ESCAPES else None
            i = j
        elif c == "[":
            j = _class_end(s, i)
            out.append(s[i:j])
            atom, i = len(out) - 1, j
        elif c == "(":
            j = i + 1
            if s.startswith("?", j):  # (?:  (?=  (?!  (?<=  (?<!  (?<name>  (?P<name>; inline flags are unknown
                rest = s[j + 1:]
                if rest[:1] in (":", "=", "!"):
                    j += 2
                elif rest[:2] in ("<=", "<!"):
                    j += 3
                elif rest[:1] == "<" or rest[:2] == "P<":
                    j = s.index(">", j) + 1 if ">" in s[j:] else n
                else:
                    raise _Unsupported
            out.append(s[i:j])
            atom, i = None, j
        elif c in "*+?":
            j = i + 1
            if j < n and s[j] in "?+":
                j += 1
            out.append(s[i:j])
            atom, i = None, j
        elif c == "{":
            m = _QUANT.match(s, i)
            if m is None:
                raise _Unsupported  # a literal brace in some dialects, an error in others
            j = m.end()
            lazy = j < n and s[j] == "?"
            if j < n and s[j] == "+":
                raise _Unsupported  # possessive: not a plain repeat
            lo, hi = int(m.group(1)), (int(m.group(3)) if m.group(3) else None) if m.group(2) else int(m.group(1))
            # (hi <= max_elements first: the written-out form holds at least hi copies, and is not built)
            if atom is not None and hi is not None and lo < hi <= max_elements and _elements(lo, hi) <= max_elements:
                out[atom] = _alternation(out[atom], lo, hi)
                i = j + (1 if lazy else 0)  # laziness changes which match a search finds, not the language
            else:
                out.append(s[i:j])
                i = j
            atom = None
        else:
            out.append(c)
            atom = len(out) - 1 if c not in "|)^$" else None
            i += 1
    return "".join(out)


def _elements(lo: int, hi: int) -> int:
    """How many copies of the atom _alternation(atom, lo, hi) writes."""
    return _alternation("a", lo, hi).count("a")


def _alternation(a: str, lo: int, hi: int) -> str:
    """a{lo,hi} as flat sequences: `a` lo times, then e = hi - lo optional more as q blocks of b and a rest r
    (e = q * b + r, r < b, b ~ sqrt(e)): an alternation of the block runs and one of the rests, each position a
    plain sequence element. ~e**1.5 / 2 copies of `a` instead of the (e + 1) e / 2 of one alternative per count
    (the compile's cost: 31 copies for {1,16} instead of 120)."""
    def upto(unit: int, n: int) -> str:  # (unit * 1 | ... | unit * n)?, or nothing
        return "(?:" + "|".join(a * (unit * k) for k in range(1, n + 1)) + ")?" if n > 0 else ""

    e = hi - lo
    b = max(1, math.isqrt(e + 1))
    q_max = e // b
    if (e + 1) % b == 0:  # every (q <= q_max, r < b) is a count <= e
        tail = upto(b, q_max) + upto(1, b - 1)
    else:  # the last block's run takes only the rest that fits
        tail = "(?:" + upto(b, q_max - 1) + upto(1, b - 1) + "|" + a * (q_max * b) + upto(1, e - q_max * b) + ")"
    return "(?:" + a * lo + tail + ")"


def _escape_end(s: str, i: int) -> int:
    """The end of the escape starting at s[i] == '\\'."""
    if i + 1 >= len(s):
        raise _Unsupported
    e = s[i + 1]
    if e.isdigit() and e != "0" or e == "k":
        raise _Unsupported  # a backreference
    if e in "pPu" and s.startswith("{", i + 2):
        close = s.find("}", i + 2)
        if close < 0:
            raise _Unsupported
        return close + 1
    if e == "x":
        return i + 4
    if e == "u":
        return i + 6
    if e == "c":
        return i + 3
    return i + 2


def _class_end(s: str, i: int) -> int:
    """The end of the character class starting at s[i] == '['."""
    j = i + 1
    if s.startswith("^", j):
        j += 1
    if s.startswith("]", j):
        raise _Unsupported  # ']' first: a literal in some dialects, an empty class in others
    while j < len(s):
        c = s[j]
        if c == "\\":
            j = _escape_end(s, j)
            continue
        if c == "[":
            raise _Unsupported  # nested sets / POSIX classes
        if c == "]":
            return j + 1
        j += 1
    raise _Unsupported


def _check_kind(kind: str, source: Any) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown constraint kind {kind!r}; expected one of {KINDS}")
    if not isinstance(source, str):
        raise TypeError(f"{kind} must be a str, got {type(source).__name__}")


def _schema_text(source: str) -> str:
    """The schema as JSON text, checked to be a JSON object: clearer errors than the converter's."""
    try:
        schema = json.loads(source)
    except json.JSONDecodeError as e:
        raise ValueError(f"invalid json_schema: not valid JSON ({e})") from None
    if not isinstance(schema, dict):
        raise ValueError(f"invalid json_schema: a schema must be a JSON object, got {type(schema).__name__} "
                         f"{source[:80]!r} (use {{}} to allow any JSON value)")
    return source


_CPP_PREFIX = re.compile(r"^\s*\[[\d:. ]+\]\s*\S+:\d+:\s*(Check failed: .*? is false: )?")


def _parser_message(e: BaseException) -> str:
    """xgrammar's message without its '[time] file.cc:line:' prefix."""
    return _CPP_PREFIX.sub("", str(e)).strip()


# ---- token bytes -------------------------------------------------------------------------------------------
class TokenVocab:
    """Each id's bytes as the grammar sees them (b'' for special / masked ids), with a sorted index to find the
    tokens whose bytes strictly extend a given token's (a prefix range of the sorted byte strings)."""

    def __init__(self, token_bytes: list[bytes]) -> None:
        self.token_bytes = token_bytes
        order = sorted((b, i) for i, b in enumerate(token_bytes) if b)
        self._sorted = [b for b, _ in order]
        self._ids = np.array([i for _, i in order], dtype=np.int64)
        self._last: np.ndarray | None = None
        self._single: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.token_bytes)

    def join(self, ids: list[int]) -> bytes:
        return b"".join(self.token_bytes[i] for i in ids)

    @property
    def last_bytes(self) -> np.ndarray:
        """Each id's last byte (-1 for b''), built on first use (with single_byte_ids)."""
        if self._last is None:
            self._last = np.array([b[-1] if b else -1 for b in self.token_bytes], dtype=np.int16)
            self._single = np.full(256, -1, dtype=np.int64)
            for i, b in enumerate(self.token_bytes):
                if len(b) == 1 and self._single[b[0]] < 0:
                    self._single[b[0]] = i
        return self._last

    @property
    def single_byte_ids(self) -> np.ndarray:
        """For each byte value the id whose bytes are that byte alone (-1 where none is)."""
        _ = self.last_bytes
        assert self._single is not None  # last_bytes built it
        return self._single

    def extenders(self, token_id: int) -> np.ndarray:
        """Ids whose bytes start with token_id's bytes and are longer."""
        b = self.token_bytes[token_id]
        if not b:
            return self._ids[:0]
        lo = bisect.bisect_right(self._sorted, b)
        upper = _prefix_upper_bound(b)
        hi = len(self._sorted) if upper is None else bisect.bisect_left(self._sorted, upper, lo)
        return self._ids[lo:hi]


def _prefix_upper_bound(b: bytes) -> bytes | None:
    """The smallest byte string greater than every string that starts with b (None: no such bound)."""
    stripped = b.rstrip(b"\xff")
    if not stripped:
        return None
    return stripped[:-1] + bytes([stripped[-1] + 1])


# ---- matcher ---------------------------------------------------------------------------------------------------
class GrammarMatcher:
    """The grammar state of one request: the tokens it accepted so far, in order (`tokens`).

    Not thread-safe: use it from one thread at a time (the scheduler's). accept_token and rollback (and
    jump_forward) change the state; the other methods only read it.
    """

    def __init__(self, compiled: CompiledGrammar, vocab: TokenVocab) -> None:
        self._m = xgr.GrammarMatcher(compiled)
        self.vocab = vocab
        self.tokens: list[int] = []
        self._scratch: torch.Tensor | None = None  # one bitmask row for jump-forward's checks
        self._not_stop: np.ndarray | None = None  # bitmask words with every bit set but the stop tokens'

    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) when the grammar does not allow it."""
        ok = self._m.accept_token(token_id)
        if ok:
            self.tokens.append(token_id)
        return ok

    def rollback(self, n: int) -> None:
        """Undo the last n accepted tokens."""
        assert 0 <= n <= len(self.tokens), (n, len(self.tokens))
        if n:
            self._m.rollback(n)
            del self.tokens[len(self.tokens) - n:]

    def is_terminated(self) -> bool:
        """The stop token was accepted: nothing more may follow."""
        return self._m.is_terminated()

    def is_completed(self) -> bool:
        """The text so far is a complete match (the stop token may come next)."""
        return self._m.is_completed()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> bool:
        """Write the allowed next tokens into bitmask[row] (a CPU int32 tensor from allocate_bitmask).
        Returns False when every token is allowed (applying the row may be skipped)."""
        return self._m.fill_next_token_bitmask(bitmask, row)

    def find_jump_forward_string(self) -> str:
        """The longest string the grammar forces from here ('' when the next character is a choice). It holds
        whole UTF-8 characters only: after a token that ends inside a character it is ''."""
        return self._m.find_jump_forward_string()

    def stop_is_forced(self) -> bool:
        """The text is complete and the grammar allows nothing but a stop token next: the engine may finish the
        request (appending the stop token) without another forward pass."""
        if self.is_terminated() or not self.is_completed():
            return False
        words = self._next_words()
        if self._not_stop is None:  # every bit but the stop tokens' (a complete number or name that may go on
            # allows thousands of tokens: comparing them as sets cost ~0.3 ms a step, this ~5 us)
            keep = np.full(words.shape, -1, dtype=words.dtype)
            for t in self._m.stop_token_ids:
                if 0 <= t < 32 * len(keep):
                    keep[t >> 5] &= ~np.array(1 << (t & 31), dtype=np.uint32).view(np.int32)
            self._not_stop = keep
        return not np.any(words & self._not_stop)

    def close_in_one(self, bitmask: torch.Tensor, row: int) -> bool:
        """For the last token of a request's budget: narrow bitmask[row] (filled for this state) to the tokens
        after which the text is a complete match, so that the output ends as a whole value rather than cut off
        (a string gets its closing quote). Returns False, leaving the row as it is, when the text is complete
        already or no single token completes it.

        Which tokens complete it is found by trying them: first every allowed single-byte token, which gives the
        bytes that end a match from here; then the allowed tokens that end in one of those bytes (`"`, ` "`,
        `_"` inside a string). A closing token that ends in another byte is missed, never a wrong one taken."""
        if self.is_completed() or self.is_terminated():
            return False
        words = bitmask[row].numpy()
        ids = np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little")[:len(self.vocab)])
        if not len(ids):
            return False
        singles = self.vocab.single_byte_ids
        enders = [b for b in np.flatnonzero(singles >= 0).tolist() if self._completes(int(singles[b]))]
        if not enders:
            return False
        candidates = ids[np.isin(self.vocab.last_bytes[ids], enders)]
        hits = [t for t in candidates.tolist() if self._completes(t)]
        if not hits:
            return False
        words[:] = 0
        hit = np.array(hits, dtype=np.int64)
        np.bitwise_or.at(words.view(np.uint32), hit >> 5, (np.uint32(1) << (hit & 31).astype(np.uint32)))
        return True

    def _completes(self, token_id: int) -> bool:
        """Accepting token_id would make the text a complete match (the state is left as it was)."""
        if not self._m.accept_token(token_id):
            return False
        done = self._m.is_completed()
        self._m.rollback(1)
        return done

    def allowed(self, ids: np.ndarray) -> np.ndarray:
        """Which of `ids` the grammar allows next (bool array)."""
        words = self._next_words()
        return ((words[ids >> 5] >> (ids & 31).astype(np.int32)) & 1).astype(bool)

    def _next_words(self) -> np.ndarray:
        """The next-token bitmask as int32 words, in a scratch row (valid until the next call)."""
        if self._scratch is None:
            self._scratch = allocate_bitmask(1, len(self.vocab))
        self._m.fill_next_token_bitmask(self._scratch, 0)
        return self._scratch[0].numpy()


# ---- jump-forward ----------------------------------------------------------------------------------------------
class JumpForward(NamedTuple):
    """Drop the last `rollback_tokens` generated tokens (crop them from the KV and the output), then append
    `forced_ids` (prefill them in one extend). The matcher has already been moved to the new state."""

    rollback_tokens: int
    forced_ids: list[int]


def jump_forward(matcher: GrammarMatcher, output_ids: list[int], tokenizer: Tokenizer, *, max_rollback: int = 4,
                 max_growth: int | None = None) -> JumpForward | None:
    """Canonical tokens for the continuation the grammar forces after `output_ids`, or None (decode normally).

    Retokenization: the bytes of the last k <= max_rollback generated tokens (the longest such tail that is
    whole UTF-8 characters and holds no special token) plus the forced string are re-encoded; the longest
    common token prefix with those k tokens stays, the rest of the k tokens are rolled back, the new tokens
    from there on are forced. So `'"'` + `',\\n    "house": "'` becomes `'",'` `'\\n   '` `' "'` ...
    (rollback 1) rather than leaving a lone `'"'` before `','`.

    The end of the forced tokens: the last one is left off when a grammar-allowed token strictly extends its
    bytes and re-encoding the text with that token's remaining bytes would not keep the boundary (BPE could
    merge it with what follows, e.g. a forced `'"'` before a choice of `':'`/`','`): the model then picks
    it, or the longer token, itself. Then tokens are dropped until the forced bytes end on a whole UTF-8
    character. Net output growth (len(forced_ids) - rollback_tokens) is capped at max_growth when given.

    The matcher must hold exactly `output_ids` (it accepted them). On success it has been rolled back and
    has accepted the forced ids; on None it is unchanged. The resulting text always extends the old text.
    """
    vocab = matcher.vocab
    if matcher.is_terminated():
        return None
    recent = max(0, len(output_ids) - max_rollback)
    assert len(matcher.tokens) == len(output_ids) and matcher.tokens[recent:] == list(output_ids[recent:]), \
        "the matcher must have accepted exactly output_ids"
    forced = matcher.find_jump_forward_string()
    if not forced:
        return None

    k, tail_bytes = _clean_tail(vocab, output_ids, max_rollback)
    tail_ids = output_ids[len(output_ids) - k:]
    text = tail_bytes.decode("utf-8") + forced
    new_ids = tokenizer.backend.encode(text, add_special_tokens=False).ids
    if max(new_ids, default=0) >= len(vocab) or vocab.join(new_ids) != text.encode("utf-8"):
        return None  # the tokenizer adds or alters bytes (a prefix space, special-token text): not safe
    p = 0
    while p < min(k, len(new_ids)) and tail_ids[p] == new_ids[p]:
        p += 1
    end = len(new_ids) if max_growth is None else min(len(new_ids), k + max_growth)
    if end <= p:
        return None

    matcher.rollback(k - p)
    for i in range(p, end):
        if not matcher.accept_token(new_ids[i]):
            _restore(matcher, i - p, tail_ids[p:])
            return None
    if _may_merge(matcher, new_ids, end, tokenizer):
        matcher.rollback(1)
        end -= 1
    while end > p and not _whole_chars(vocab.join(new_ids[:end])):
        matcher.rollback(1)
        end -= 1
    if end <= p or len(vocab.join(new_ids[:end])) <= len(tail_bytes):
        _restore(matcher, end - p, tail_ids[p:])
        return None
    return JumpForward(k - p, new_ids[p:end])


def _clean_tail(vocab: TokenVocab, output_ids: list[int], max_rollback: int) -> tuple[int, bytes]:
    """The largest k <= max_rollback whose last-k tokens are whole UTF-8 text with no special token."""
    for k in range(min(max_rollback, len(output_ids)), 0, -1):
        tail = output_ids[len(output_ids) - k:]
        if all(vocab.token_bytes[t] for t in tail):
            data = vocab.join(tail)
            if _whole_chars(data):
                return k, data
    return 0, b""


def _whole_chars(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _restore(matcher: GrammarMatcher, accepted: int, original: list[int]) -> None:
    """Undo `accepted` forced tokens and re-accept the rolled-back original ones."""
    matcher.rollback(accepted)
    for t in original:
        ok = matcher.accept_token(t)
        assert ok, "re-accepting tokens the matcher accepted before"


def _may_merge(matcher: GrammarMatcher, ids: list[int], end: int, tokenizer: Tokenizer) -> bool:
    """Could the forced token ids[end-1] merge with text the model writes next? Checks every grammar-allowed
    token that strictly extends its bytes: a merge is possible when re-encoding the forced text plus that
    token's remaining bytes does not reproduce ids[:end]. Leaves the matcher where it was."""
    vocab = matcher.vocab
    last = ids[end - 1]
    candidates = vocab.extenders(last)
    if len(candidates) == 0:
        return False
    matcher.rollback(1)
    allowed = candidates[matcher.allowed(candidates)]
    ok = matcher.accept_token(last)
    assert ok
    if len(allowed) == 0:
        return False
    if len(allowed) > MAX_EXTENDERS_CHECKED:
        return True
    head = vocab.join(ids[:end])
    size = len(vocab.token_bytes[last])
    for e in allowed.tolist():
        try:
            text = (head + vocab.token_bytes[e][size:]).decode("utf-8")
        except UnicodeDecodeError:
            return True  # the extension ends inside a character: cannot check, be safe
        if tokenizer.backend.encode(text, add_special_tokens=False).ids[:end] != ids[:end]:
            return True
    return False


# ---- bitmasks --------------------------------------------------------------------------------------------------
def allocate_bitmask(batch: int, vocab_size: int) -> torch.Tensor:
    """An all-allowed int32 bitmask (batch, ceil(vocab_size / 32)) on CPU; bit j of word w is token 32*w + j."""
    return torch.full((batch, (vocab_size + 31) // 32), -1, dtype=torch.int32)


_BIT = (1 << torch.arange(32, dtype=torch.int64)).to(torch.int32)  # bit 31 wraps to INT32_MIN, as wanted


def apply_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None = None) -> None:
    """In place: logits[r, t] = -inf where bit t of bitmask[r] is 0, for r in rows (default: all rows).

    logits (B, V) float; bitmask (B', W) int32 on the same device, W*32 >= V or columns past W*32 are masked.
    """
    assert logits.dim() == 2 and bitmask.dim() == 2 and bitmask.dtype == torch.int32, (logits.shape, bitmask.dtype)
    B, V = logits.shape
    W = bitmask.shape[1]
    if rows is None:
        assert bitmask.shape[0] >= B
        rows = list(range(B))
    if not rows:
        return
    idx = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    bits = bitmask[idx].unsqueeze(-1).bitwise_and(_BIT.to(bitmask.device))  # (R, W, 32)
    banned = bits.eq(0).flatten(1)  # (R, W*32)
    if W * 32 >= V:
        banned = banned[:, :V]
    else:
        banned = torch.cat([banned, banned.new_ones(len(rows), V - W * 32)], dim=1)  # (R, V)
    if len(rows) == B and rows == list(range(B)):
        logits.masked_fill_(banned, float("-inf"))
    else:
        logits[idx] = logits[idx].masked_fill(banned, float("-inf"))


def apply_bitmask_xgrammar(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None = None) -> None:
    """Same contract as apply_bitmask_torch, through xgrammar's kernel (C++ for CPU tensors, CUDA/Triton when
    both tensors are on a GPU)."""
    assert logits.dim() == 2 and bitmask.dim() == 2 and bitmask.dtype == torch.int32, (logits.shape, bitmask.dtype)
    V = logits.shape[1]
    W = bitmask.shape[1]
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=min(V, W * 32), indices=rows)
    if W * 32 < V:  # xgrammar leaves columns past the bitmask unmasked
        if rows is None:
            logits[:, W * 32:] = float("-inf")
        else:
            logits[rows, W * 32:] = float("-inf")


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None = None) -> None:
    """On a GPU our Triton kernel (sgnb.kernels.bitmask: one launch, no (B, V) temporaries). On CPU xgrammar's
    kernel: faster than the torch unpack on permissive masks (free text: the states where jump-forward cannot help
    and tokens are really sampled), slower on restrictive ones at B >= 4 (benchmarks/results/NOTES.md); it also
    makes no (B, V) temporaries."""
    if logits.is_cuda:
        from sgnb.kernels.bitmask import apply_token_bitmask

        apply_token_bitmask(logits, bitmask, rows)
        return
    apply_bitmask_xgrammar(logits, bitmask, rows)
