"""Structured output over xgrammar: compile cache, validation, masks, random walks, jump-forward retokenization.

Runs on the real SmolLM2 tokenizer (no model): "decoding" is a random walk that picks an allowed token from the
grammar's bitmask with a seeded RNG, so every step exercises the same calls the scheduler makes.
"""

from __future__ import annotations

import json
import random
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sgnb.engine import grammar as G
from sgnb.engine.model_loader import load_tokenizer, resolve_model

VOCAB = 49152  # SmolLM2's model vocabulary (= its tokenizer's)

_S = r"[A-Za-z0-9 ]{1,16}"
CHARACTER_REGEX = (
    r'\{\n    "name": "' + _S + r'",\n'
    r'    "house": "(Gryffindor|Slytherin|Ravenclaw|Hufflepuff)",\n'
    r'    "blood status": "(Pure-blood|Half-blood|Muggle-born)",\n'
    r'    "occupation": "(student|teacher|auror|ministry of magic|death eater|order of the phoenix)",\n'
    r'    "wand": \{\n'
    r'        "wood": "' + _S + r'",\n'
    r'        "core": "' + _S + r'",\n'
    r'        "length": [0-9]{1,2}\.[0-9]{0,2}\n'
    r'    \},\n'
    r'    "alive": "(Alive|Deceased)",\n'
    r'    "patronus": "' + _S + r'",\n'
    r'    "bogart": "' + _S + r'"\n'
    r'\}'
)
CHARACTER_TEXT = (
    '{\n    "name": "Hermione Granger",\n    "house": "Gryffindor",\n    "blood status": "Muggle-born",\n'
    '    "occupation": "student",\n    "wand": {\n        "wood": "Vine",\n        "core": "Dragon heart",\n'
    '        "length": 10.75\n    },\n    "alive": "Alive",\n    "patronus": "Otter",\n    "bogart": "Failure"\n}'
)
CITY_REGEX = r'\{"city": "(Zürich|東京|Zug)", "n": [0-9]\}'

REGEXES = [
    r"((25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])",  # alternations
    r"(cat|dog|bird)( and (cat|dog|bird)){0,3}",
    r"[a-z]{2,5}(-[a-z]{1,3})*",  # repetitions
    r"-?(0|[1-9][0-9]{0,6})(\.[0-9]{1,4})?([eE][+-]?[0-9]{1,2})?",  # numbers
    r'"([^"\\]|\\["\\nt]){0,12}"',  # escapes
    r"(Zürich|東京|Москва|café) ?[αβγ]{1,3}",  # unicode
    r"[a-z0-9_]{1,10}@[a-z]{1,8}\.(com|org|net)",
    r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",
    r"(a(b(c)?)?)+x",
    CITY_REGEX,
    CHARACTER_REGEX,
]
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 150}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "id": {"type": "integer"},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3}},
            "required": ["id", "tags"]},
        "active": {"type": "boolean"}},
     "required": ["user", "active"]},
    {"type": "object", "properties": {"city": {"enum": ["Zürich", "東京", 'New "York"', "Oslo"]},
                                      "n": {"type": "number"}},
     "required": ["city", "n"]},
    {"type": "array", "items": {"type": "number"}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                                      "note": {"type": ["string", "null"], "maxLength": 10}},
     "required": ["code", "note"]},
    {"anyOf": [
        {"type": "object", "properties": {"kind": {"const": "a"}, "x": {"type": "integer"}}, "required": ["kind", "x"]},
        {"type": "object", "properties": {"kind": {"const": "b"}, "y": {"type": "boolean"}}, "required": ["kind", "y"]}]},
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(resolve_model("smollm2"))


@pytest.fixture(scope="module")
def backend(tok):
    be = G.GrammarBackend(tok, VOCAB)
    yield be
    be.close()


# ---- the walk -----------------------------------------------------------------------------------------------
def allowed_mask(bitmask: torch.Tensor, row: int, vocab: int) -> np.ndarray:
    """bool (vocab,) of the tokens bitmask[row] allows (an independent unpacking: numpy's unpackbits)."""
    return np.unpackbits(bitmask[row].numpy().view(np.uint8), bitorder="little")[:vocab].astype(bool)


class Walker:
    """Random walks through a grammar; counts sampled tokens (= forward passes: a jump-forward extend also
    yields the logits of the next sampled token)."""

    FINISH_AFTER = 120  # then prefer the stop token and closing quotes / brackets so the walk terminates

    def __init__(self, backend: G.GrammarBackend, tok) -> None:
        self.backend, self.tok = backend, tok
        self.eos = tok.eos_token_ids[0]
        tb = backend.vocab.token_bytes
        self.closer = np.array([bool(b) and set(b) <= set(b'"}])') for b in tb])
        self.short = np.array([len(b) == 1 for b in tb])
        self.space = np.array([bool(b) and not b.strip() for b in tb])  # whitespace-only tokens
        self.bitmask = backend.allocate_bitmask(1)

    def run(self, compiled, seed: int, jf: bool, max_tokens: int = 200, checks=None):
        rng = random.Random(seed)
        m = self.backend.matcher(compiled)
        out: list[int] = []
        sampled = 0
        jumps: list[G.JumpForward] = []
        while not m.is_terminated() and len(out) < max_tokens:
            if jf:
                j = G.jump_forward(m, out, self.tok, max_growth=max_tokens - len(out))
                if j is not None:
                    before = self.tok.decode(out)
                    del out[len(out) - j.rollback_tokens:]
                    out += j.forced_ids
                    assert m.tokens == out
                    assert self.tok.decode(out).startswith(before)  # text only grows
                    jumps.append(j)
                    if len(out) >= max_tokens:
                        break
            m.fill_bitmask(self.bitmask, 0)
            allowed = allowed_mask(self.bitmask, 0, self.backend.vocab_size)
            if checks is not None:
                checks(m, out, allowed)
            token = self.choose(allowed, rng, sampled)
            assert m.accept_token(token), (token, self.tok.token_text(token))
            out.append(token)
            sampled += 1
        return out, sampled, m.is_terminated(), jumps

    def choose(self, allowed: np.ndarray, rng: random.Random, sampled: int) -> int:
        finishing = sampled >= self.FINISH_AFTER
        if allowed[self.eos] and (finishing or rng.random() < 0.3):
            return self.eos
        if finishing:
            for pref in (self.closer, self.short):
                ids = np.flatnonzero(allowed & pref)
                if len(ids):
                    return int(ids[rng.randrange(len(ids))])
        ids = np.flatnonzero(allowed & ~self.space) if rng.random() < 0.9 else []
        if not len(ids):  # JSON allows any whitespace between items: ~1.4k such tokens would dominate the walk
            ids = np.flatnonzero(allowed)
        return int(ids[rng.randrange(len(ids))])

    def text(self, out: list[int]) -> str:
        return self.tok.decode(out[:-1] if out and out[-1] == self.eos else out)


@pytest.fixture(scope="module")
def walker(backend, tok):
    return Walker(backend, tok)


# ---- compile, cache, validation -------------------------------------------------------------------------------
def test_compile_cache_counts_once_per_constraint(backend):
    src = r"[a-z]{3}-[0-9]{2,4}"
    before = backend.compile_count
    with ThreadPoolExecutor(8) as pool:  # a batch of identical constraints arriving at once
        futs = list(pool.map(lambda _: backend.compile_async("regex", src), range(16)))
    grammars = {id(f.result()) for f in futs}
    assert len(grammars) == 1 and backend.compile_count == before + 1
    assert backend.compile("regex", src) is futs[0].result() and backend.compile_count == before + 1
    backend.compile("ebnf", 'root ::= "a" | "b"')
    backend.compile("json_schema", json.dumps(SCHEMAS[0]))
    backend.compile("json_schema", json.dumps(SCHEMAS[0]))
    assert backend.compile_count == before + 3


def test_invalid_constraints_raise_value_error_with_the_parsers_message(backend):
    cases = [
        ("regex", "(a", "parenthesis is not closed"),
        ("regex", "[z-a]", "lower bound is larger than upper bound"),
        ("json_schema", '{"type": "objec"}', 'Unsupported type "objec"'),
        ("json_schema", "{bad", "not valid JSON"),
        ("json_schema", "[1, 2]", "must be a JSON object, got list"),
        ("json_schema", '"string"', "must be a JSON object, got str"),
        ("json_schema", '{"type": "string", "pattern": "(a"}', "parenthesis is not closed"),
        ("ebnf", "root ::= foo", 'Rule "foo" is not defined'),
        ("ebnf", 'root ::= "a" |', "Expect element"),
    ]
    for kind, source, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            backend.validate(kind, source)
        n = backend.compile_count
        with pytest.raises(ValueError, match=re.escape(message)):
            backend.compile(kind, source)
        with pytest.raises(ValueError):  # failures are not cached: it compiles (and fails) again
            backend.compile(kind, source)
        assert backend.compile_count == n + 2
    with pytest.raises(ValueError) as info:
        backend.validate("regex", "(a")
    assert str(info.value).startswith("invalid regex: Regex parsing error")  # no '[time] file.cc:line' prefix
    with pytest.raises(ValueError, match="unknown constraint kind"):
        backend.validate("yaml", "a: b")
    backend.validate("regex", CHARACTER_REGEX)
    backend.validate("json_schema", json.dumps(SCHEMAS[1]))
    backend.validate("ebnf", 'root ::= "x" [0-9]+')


def test_constraint_of_sampling_params():
    from sgnb.engine.sampling_params import SamplingParams

    assert G.constraint_of(SamplingParams()) is None
    assert G.constraint_of(SamplingParams.from_dict({"regex": "a+"})) == ("regex", "a+")
    assert G.constraint_of(SamplingParams.from_dict({"json_schema": {"type": "object"}})) == \
        ("json_schema", '{"type": "object"}')


# ---- masks ----------------------------------------------------------------------------------------------------
def test_special_tokens_are_masked_inside_constrained_strings(tok):
    be = G.GrammarBackend(tok, VOCAB + 64)  # a model vocabulary wider than the tokenizer's
    walker = Walker(be, tok)
    special = sorted(tok.special_token_ids)
    eos = tok.eos_token_ids[0]
    assert "<repo_name>" in tok.decode(special, skip_special_tokens=False)
    seen_eos = []

    def checks(m, out, allowed):
        assert not allowed[VOCAB:].any(), "ids past the tokenizer are masked"
        assert not allowed[[s for s in special if s != eos]].any(), "special tokens are masked"
        seen_eos.append(bool(allowed[eos]) == m.is_completed())  # the stop token exactly when complete

    for kind, source in [("json_schema", json.dumps({"type": "object", "properties": {"s": {"type": "string"}},
                                                     "required": ["s"]})),
                         ("regex", r'"[^"]{0,40}"'), ("ebnf", 'root ::= "<" [a-z_|<>]* ">"')]:
        for seed in range(3):
            out, _, terminated, _ = walker.run(be.compile(kind, source), seed, jf=False, checks=checks)
            assert terminated
    assert all(seen_eos)


@pytest.mark.parametrize("vocab", [VOCAB, 1000])
def test_apply_bitmask_torch_matches_xgrammar(vocab):
    gen = torch.Generator().manual_seed(0)
    B = 5
    for density in (0.0, 0.01, 0.5, 1.0):
        bitmask = G.allocate_bitmask(B, vocab)
        bits = torch.rand(B, bitmask.shape[1] * 32, generator=gen) < density
        packed = (bits.view(B, -1, 32).to(torch.int64) << torch.arange(32)).sum(-1)  # (B, W) in [0, 2^32)
        bitmask.copy_(packed.to(torch.int64).sub((packed >= 2**31).to(torch.int64) << 32).to(torch.int32))
        logits = torch.randn(B, vocab, generator=gen)
        for rows in (None, [1, 3], [4], []):
            a, b = logits.clone(), logits.clone()
            G.apply_bitmask_torch(a, bitmask, rows)
            G.apply_bitmask_xgrammar(b, bitmask, rows)
            assert torch.equal(a, b)
            want = logits.clone()
            for r in (range(B) if rows is None else rows):
                want[r, ~bits[r, :vocab]] = float("-inf")
            assert torch.equal(a, want)
    # logits wider than the bitmask: the extra columns are masked by both
    bitmask = G.allocate_bitmask(2, 64)
    logits = torch.zeros(2, 100)
    for apply in (G.apply_bitmask_torch, G.apply_bitmask_xgrammar, G.apply_bitmask):
        x = logits.clone()
        apply(x, bitmask, None)
        assert torch.isinf(x[:, 64:]).all() and not torch.isinf(x[:, :64]).any()


@pytest.mark.parametrize("mask_threads", [None, 1, 4])
def test_fill_bitmasks_batched_matches_one_by_one(backend, tok, mask_threads):
    """Whatever number of C++ threads fill a step's masks (None: the machine's default)."""
    if mask_threads is not None:
        own = G.GrammarBackend(tok, backend.vocab_size, mask_threads=mask_threads)
        try:
            _check_batched_fill(own, tok)
        finally:
            own.close()
    else:
        _check_batched_fill(backend, tok)


def _check_batched_fill(backend, tok) -> None:
    compiled = [backend.compile("regex", r) for r in REGEXES[:6]]
    matchers = [backend.matcher(c) for c in compiled]
    for m, text in zip(matchers[1:3], ["cat and d", "ab-c"]):
        for t in tok.backend.encode(text, add_special_tokens=False).ids:
            assert m.accept_token(t)
    rows = [7, 0, 3, 2, 5, 1]
    batched = backend.allocate_bitmask(8)
    backend.fill_bitmasks(matchers, batched, rows)
    single = backend.allocate_bitmask(8)
    for m, r in zip(matchers, rows):
        m.fill_bitmask(single, r)
    assert torch.equal(batched, single)


# ---- bounded repeats written out -------------------------------------------------------------------------------
_ATOMS = ["a", "b", "[ab]", "[^a]", r"\d", r"\w", ".", r"\.", "[a-c1]"]
_QUANTS = ["", "?", "*", "+", "{2}", "{0,2}", "{1,3}", "{2,4}", "{1,}", "{0,5}?", "{3,6}"]


@st.composite
def _regexes(draw, depth: int = 2):
    """Small regexes over a few atoms: quantified atoms and groups, concatenated and alternated."""
    parts = []
    for _ in range(draw(st.integers(1, 4))):
        if depth and draw(st.integers(0, 4)) == 0:
            body = draw(_regexes(depth=depth - 1))
            parts.append("(" + draw(st.sampled_from(["", "?:"])) + body + ")" + draw(st.sampled_from(_QUANTS)))
        else:
            parts.append(draw(st.sampled_from(_ATOMS)) + draw(st.sampled_from(_QUANTS)))
    alt = "".join(parts)
    return alt + ("|" + draw(_regexes(depth=0)) if depth and draw(st.booleans()) else "")


@settings(max_examples=300, deadline=None, derandomize=True)
@given(pattern=_regexes(), texts=st.lists(st.text("ab1.c x", max_size=9), min_size=8, max_size=8))
def test_flattened_bounded_repeats_match_the_same_strings(pattern, texts):
    """The rewrite keeps the language (Python's re as the oracle), on strings drawn near the pattern's own."""
    flat = G.flatten_bounded_repeats(pattern)
    samples = texts + ["", "a", "ab", "aa1", "aaaa", "1.1", "bbb", "abab", "a1a1a1"]
    for text in samples:
        assert bool(re.fullmatch(pattern, text)) == bool(re.fullmatch(flat, text)), (pattern, flat, text)


def test_flattened_repeat_counts_exactly_lo_to_hi():
    """Every written-out form (blocks and rests, the last block's partial rest) matches a run of n atoms for
    exactly lo <= n <= hi (kept out of the generated regexes above: nested blocks backtrack for long in re)."""
    for lo in range(4):
        for hi in range(lo + 1, 40):
            flat = G.flatten_bounded_repeats(f"a{{{lo},{hi}}}")
            for n in range(hi + 3):
                assert bool(re.fullmatch(flat, "a" * n)) == (lo <= n <= hi), (lo, hi, n, flat)


@pytest.mark.parametrize("pattern, expected", [
    (r"[a-z]{1,3}", r"(?:[a-z](?:[a-z]|[a-z][a-z])?)"),
    (r"\w{0,2}!", r"(?:(?:\w|\w\w)?)!"),
    (r"x{2,3}?y", r"(?:xx(?:x)?)y"),  # lazy: the same language
    (r"(ab){1,3}", r"(ab){1,3}"),  # a group: left alone
    (r"x{3}|\d{2,}", r"x{3}|\d{2,}"),  # exact and open counts: no chain to flatten
    (r"(a)\1{1,2}", r"(a)\1{1,2}"),  # backreference: unknown ground, the whole regex stays
    (r"a{1,3}+", r"a{1,3}+"),  # possessive
    (r"(?i)a{1,2}", r"(?i)a{1,2}"),  # inline flags
    (r"[]a]{1,2}", r"[]a]{1,2}"),  # ']' first in a class
    (r"a{,2}", r"a{,2}"),  # not a quantifier everywhere
    ("a{0,8}", "(?:(?:aaa|aaaaaa)?(?:a|aa)?)"),  # blocks of 3 and a rest
    ("a{0,9}", "(?:(?:(?:aaa|aaaaaa)?(?:a|aa)?|aaaaaaaaa))"),  # the last block's run takes what fits
    ("[a-z]{1,40}", "[a-z]{1,40}"),  # past the compile budget
])
def test_flatten_bounded_repeats_rewrites_only_what_it_understands(pattern, expected):
    assert G.flatten_bounded_repeats(pattern) == expected


@pytest.mark.parametrize("pattern", [CHARACTER_REGEX, REGEXES[2], REGEXES[3], REGEXES[5], REGEXES[6]])
def test_flattened_regex_masks_equal_xgrammars_chain(backend, walker, pattern):
    """The backend compiles the written-out form; its masks (and jump-forward strings) are the chain's exactly,
    at every step of random walks."""
    flat = G.flatten_bounded_repeats(pattern)
    assert flat != pattern
    chain_grammar = backend.compiler.compile_regex(pattern)
    compiled = backend.compile("regex", pattern)
    bitmask = backend.allocate_bitmask(1)
    chain = backend.matcher(chain_grammar)
    steps = 0

    def same(m, out, allowed):
        nonlocal chain, steps
        if chain.tokens != out:  # the walk jumped forward (rolling back a token or two): replay its tokens
            chain = backend.matcher(chain_grammar)
            for t in out:
                assert chain.accept_token(t)
        chain.fill_bitmask(bitmask, 0)
        assert np.array_equal(allowed_mask(bitmask, 0, backend.vocab_size), allowed)
        steps += 1

    for seed in range(6):
        chain = backend.matcher(chain_grammar)
        walker.run(compiled, seed, jf=seed % 2 == 1, checks=same)
    assert steps >= 12  # the walks did reach the repeats (a walk stops at the stop token when it may)


# ---- random walks ---------------------------------------------------------------------------------------------
_WALK_SETTINGS = settings(max_examples=60, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@_WALK_SETTINGS
@given(pattern=st.sampled_from(REGEXES), seed=st.integers(0, 2**31), jf=st.booleans())
def test_random_walks_match_the_regex(backend, walker, pattern, seed, jf):
    out, _, terminated, _ = walker.run(backend.compile("regex", pattern), seed, jf)
    assert terminated, walker.text(out)
    assert re.fullmatch(pattern, walker.text(out)), walker.text(out)


@_WALK_SETTINGS
@given(schema=st.sampled_from(SCHEMAS), seed=st.integers(0, 2**31), jf=st.booleans())
def test_random_walks_validate_against_the_json_schema(backend, walker, schema, seed, jf):
    out, _, terminated, _ = walker.run(backend.compile("json_schema", json.dumps(schema)), seed, jf)
    assert terminated, walker.text(out)
    jsonschema.validate(json.loads(walker.text(out)), schema)


def test_random_walks_follow_an_ebnf_grammar(backend, walker):
    grammar = r'''
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= [0-9]+ | "(" expr ")"
'''
    compiled = backend.compile("ebnf", grammar)
    for seed in range(8):
        out, _, terminated, _ = walker.run(compiled, seed, jf=seed % 2 == 1)
        assert terminated
        text = walker.text(out)
        reduced = re.sub(r"[0-9]+", "n", text)  # reduce the expression bottom-up: it must collapse to one "n"
        while reduced != (reduced := re.sub(r"\(n\)|n[-+*/]n", "n", reduced)):
            pass
        assert reduced == "n", text


# ---- jump-forward ---------------------------------------------------------------------------------------------
def test_jump_forward_on_the_character_regex_takes_far_fewer_decode_steps(backend, walker, capsys):
    compiled = backend.compile("regex", CHARACTER_REGEX)
    plain, jumped = [], []
    for seed in range(4):
        for jf, counts in ((False, plain), (True, jumped)):
            out, sampled, terminated, jumps = walker.run(compiled, seed, jf, max_tokens=400)
            assert terminated and re.fullmatch(CHARACTER_REGEX, walker.text(out)), walker.text(out)
            counts.append(sampled)
            if jf:
                assert len(jumps) >= 10 and any(j.rollback_tokens for j in jumps)
    with capsys.disabled():
        print(f"\ncharacter regex, decode steps per output: without jump-forward {plain}, with {jumped}")
    assert sum(jumped) * 3 < sum(plain)


def _follow(backend, tok, compiled, target: str, jf: bool):
    """Decode `target` through the grammar: at each step take the longest allowed token that is a prefix of
    the rest of the target (the same choices with and without jump-forward)."""
    m = backend.matcher(compiled)
    tb = backend.vocab.token_bytes
    goal = target.encode()
    bitmask = backend.allocate_bitmask(1)
    out: list[int] = []
    sampled = 0
    eos = tok.eos_token_ids[0]
    while not m.is_terminated():
        if jf:
            j = G.jump_forward(m, out, tok)
            if j is not None:
                del out[len(out) - j.rollback_tokens:]
                out += j.forced_ids
        done = backend.vocab.join(out)
        assert goal.startswith(done)
        rest = goal[len(done):]
        m.fill_bitmask(bitmask, 0)
        allowed = np.flatnonzero(allowed_mask(bitmask, 0, backend.vocab_size))
        fits = [t for t in allowed.tolist() if tb[t] and rest.startswith(tb[t])]
        token = max(fits, key=lambda t: len(tb[t])) if fits else eos
        assert m.accept_token(token)
        out.append(token)
        sampled += 1
    assert out[-1] == eos
    return out[:-1], sampled


@pytest.mark.parametrize("pattern, target", [
    (CHARACTER_REGEX, CHARACTER_TEXT),
    (CITY_REGEX, '{"city": "東京", "n": 7}'),
    (CITY_REGEX, '{"city": "Zürich", "n": 0}'),
])
def test_jump_forward_gives_the_same_text_for_the_same_choices(backend, tok, pattern, target):
    compiled = backend.compile("regex", pattern)
    plain, plain_steps = _follow(backend, tok, compiled, target, jf=False)
    jumped, jumped_steps = _follow(backend, tok, compiled, target, jf=True)
    assert tok.decode(plain) == tok.decode(jumped) == target
    assert jumped_steps < plain_steps
    if pattern == CHARACTER_REGEX:
        assert jumped_steps * 2 < plain_steps  # 106 -> 27
    else:  # every forced stretch came out as the tokenizer's own split
        assert jumped == tok.backend.encode(target, add_special_tokens=False).ids


def _accept(m, ids):
    for t in ids:
        assert m.accept_token(t)
    return list(ids)


def test_forced_text_merges_with_the_previous_token(backend, tok):
    enc = lambda s: tok.backend.encode(s, add_special_tokens=False).ids  # noqa: E731
    compiled = backend.compile("regex", r'\{"a": "[a-z]{1,8}", "b": "[a-z]{1,8}"\}')
    m = backend.matcher(compiled)
    start = G.jump_forward(m, [], tok)
    assert start is not None and start.rollback_tokens == 0
    out = list(start.forced_ids)
    assert tok.decode(out) == '{"a": "'
    quote = tok.token_to_id('"')
    out += _accept(m, enc("xy") + [quote])  # the model closes the string with a lone '"'
    j = G.jump_forward(m, out, tok)
    assert j is not None and j.rollback_tokens == 1
    assert j.forced_ids[0] == tok.token_to_id('",')  # '"' + ', "b": "' retokenizes to '",' ...
    out = out[: len(out) - j.rollback_tokens] + j.forced_ids
    assert m.tokens == out
    assert tok.decode(out) == '{"a": "xy", "b": "'
    assert out[-len(enc('", "b": "')):] == enc('", "b": "')  # the canonical tokens
    # and the grammar continues from the new state
    out += _accept(m, enc("z"))
    assert tok.decode(out) == '{"a": "xy", "b": "z'


def test_jump_forward_keeps_utf8_characters_whole(backend, tok):
    compiled = backend.compile("regex", CITY_REGEX)
    m = backend.matcher(compiled)
    out = list(G.jump_forward(m, [], tok).forced_ids)
    assert tok.decode(out) == '{"city": "'
    tokyo = tok.backend.encode("東京", add_special_tokens=False).ids
    tb = backend.vocab.token_bytes
    assert len(tokyo) == 4 and not G._whole_chars(tb[tokyo[0]])  # 東 and 京 are two byte-level tokens each
    out += _accept(m, tokyo[:1])  # the model wrote half of 東: nothing is forced until the character is whole
    assert G.jump_forward(m, out, tok) is None
    out += _accept(m, tokyo[1:2])
    # growth capped at one token would end inside 京: no jump rather than half a character
    assert G.jump_forward(m, out, tok, max_growth=1) is None and m.tokens == out
    j = G.jump_forward(m, out, tok, max_growth=2)
    assert j is not None and j.forced_ids == tokyo[2:]
    out = out[: len(out) - j.rollback_tokens] + j.forced_ids
    assert tok.decode(out) == '{"city": "東京'
    j = G.jump_forward(m, out, tok)
    out = out[: len(out) - j.rollback_tokens] + j.forced_ids
    assert tok.decode(out) == '{"city": "東京", "n": '
    assert "\ufffd" not in tok.decode(out)
    # Zürich | Zug: after "Z" the next character is a choice; after "ü" the rest is forced
    m2 = backend.matcher(compiled)
    out2 = list(G.jump_forward(m2, [], tok).forced_ids)
    out2 += _accept(m2, [tok.token_to_id("Z")])
    assert G.jump_forward(m2, out2, tok) is None
    out2 += _accept(m2, tok.backend.encode("ü", add_special_tokens=False).ids)
    j = G.jump_forward(m2, out2, tok)
    out2 = out2[: len(out2) - j.rollback_tokens] + j.forced_ids
    assert tok.decode(out2) == '{"city": "Zürich", "n": '


def test_jump_forward_leaves_off_a_last_token_that_could_merge(backend, tok):
    # after "k" the grammar forces '"' and then a choice of ':' or ','; '":' and '",' are single tokens, so a
    # forced lone '"' would not be the tokenizer's split: it is left to the model
    compiled = backend.compile("regex", r'k"(: 1|, 2)')
    m = backend.matcher(compiled)
    out = _accept(m, [tok.token_to_id("k")])
    assert m.find_jump_forward_string() == '"'
    assert G.jump_forward(m, out, tok) is None and m.tokens == out
    # a forced ' ' before a digit stays: SmolLM2 splits digits, so ' ' + '1' never merges
    compiled = backend.compile("regex", r'x: [0-9]')
    m = backend.matcher(compiled)
    out = _accept(m, [tok.token_to_id("x")])
    j = G.jump_forward(m, out, tok)
    assert j is not None and tok.decode(out[: len(out) - j.rollback_tokens] + j.forced_ids) == "x: "


def test_stop_is_forced_only_when_nothing_but_the_stop_token_may_follow(backend, tok):
    m = backend.matcher(backend.compile("regex", r"ab(c)?"))
    out = _accept(m, tok.backend.encode("ab", add_special_tokens=False).ids)
    assert m.is_completed() and not m.stop_is_forced()  # "c" may still follow
    _accept(m, [tok.token_to_id("c")])
    assert m.stop_is_forced()
    assert m.accept_token(tok.eos_token_ids[0]) and m.is_terminated() and not m.stop_is_forced()
    assert out


def test_jump_forward_failure_leaves_the_matcher_unchanged(backend, tok):
    # the forced text holds a special token's text: the tokenizer encodes it as the (masked) special id
    compiled = backend.compile("regex", r"a<\|im_end\|>b[0-9]")
    m = backend.matcher(compiled)
    out = _accept(m, [tok.token_to_id("a")])
    assert G.jump_forward(m, out, tok) is None
    assert m.tokens == out and m.find_jump_forward_string() == "<|im_end|>b"


@pytest.mark.parametrize("pattern, prefix, closers", [
    (r'"[\w\d ]*"', '"UTC21', ['"', ' "', '_"']),
    (r"-?(0|[1-9][0-9]*)(\.[0-9]+)?", "3.", list("0123456789")),
    (r'\{"a": [0-9]+\}', '{"a": 12', ["}"]),
])
def test_close_in_one_keeps_exactly_the_tokens_that_complete_the_match(backend, tok, pattern, prefix, closers):
    m = backend.matcher(backend.compile("regex", pattern))
    _accept(m, tok.encode(prefix))
    bitmask = backend.allocate_bitmask(2)
    m.fill_bitmask(bitmask, 1)
    before = allowed_mask(bitmask, 1, backend.vocab_size)
    assert m.close_in_one(bitmask, 1)
    kept = np.flatnonzero(allowed_mask(bitmask, 1, backend.vocab_size))
    assert set(tok.token_text(int(t)) for t in kept) >= set(closers)
    completing = set()
    for t in np.flatnonzero(before).tolist():  # an independent check of every token the row allowed
        assert m.accept_token(t)
        if m.is_completed():
            completing.add(t)
        m.rollback(1)
    assert set(kept.tolist()) == completing  # none wrongly kept; none missed on these grammars
    assert m.tokens == tok.encode(prefix)  # the probing left the state as it was
    assert (allowed_mask(bitmask, 0, backend.vocab_size)).all()  # other rows untouched


def test_close_in_one_leaves_a_complete_or_unclosable_text_alone(backend, tok):
    m = backend.matcher(backend.compile("regex", r"[0-9]+"))
    _accept(m, tok.encode("12"))
    bitmask = backend.allocate_bitmask(1)
    m.fill_bitmask(bitmask, 0)
    row = bitmask.clone()
    assert not m.close_in_one(bitmask, 0) and torch.equal(bitmask, row)  # complete already
    m = backend.matcher(backend.compile("regex", r"ab[0-9]{3}"))
    _accept(m, tok.encode("ab"))
    m.fill_bitmask(bitmask, 0)
    row = bitmask.clone()
    assert not m.close_in_one(bitmask, 0) and torch.equal(bitmask, row)  # three digits left: no one token does
