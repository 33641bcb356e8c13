"""Structured output through the engine: constrained samples always match, jump-forward saves decode steps
and keeps outputs, compiles are shared, bad constraints fail before model work."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

REGEXES = [
    r"(yes|no|maybe)",
    r"[0-9]{1,3}(\.[0-9]{1,2})?",
    r"(Paris|London|東京|Zürich), population [1-9][0-9]{0,5}",
    r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)",
    r"\"([^\"\\]|\\\\.){0,12}\"",  # a quoted string with escapes
    r"(ab|cd){2,4}-[A-Z]",
]
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                                               "maxItems": 2},
                                      "point": {"type": "object", "properties": {"x": {"type": "number"},
                                                                                 "y": {"type": "number"}},
                                                "required": ["x", "y"], "additionalProperties": False}},
     "required": ["color", "point"], "additionalProperties": False},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3},
]
PROMPT = "Output:"


def _sp(**kw):
    return {"max_new_tokens": 96, "temperature": 1.0, **kw}


@pytest.mark.parametrize("regex", REGEXES)
def test_samples_match_regex(engine, regex):
    outs = engine.generate([PROMPT] * 3, [_sp(regex=regex, seed=s) for s in range(3)])
    for o in outs:
        assert o["meta_info"]["finish_reason"]["type"] == "stop", o
        assert re.fullmatch(regex, o["text"]), (regex, o["text"])


@pytest.mark.parametrize("schema", SCHEMAS, ids=["person", "nested", "array"])
def test_samples_validate_against_schema(engine, schema):
    outs = engine.generate(["Give JSON:"] * 3, [_sp(json_schema=json.dumps(schema), seed=s, max_new_tokens=160)
                                                for s in range(3)])
    for o in outs:
        assert o["meta_info"]["finish_reason"]["type"] == "stop", o
        jsonschema.validate(json.loads(o["text"]), schema)


_word = st.text(alphabet="abcxyz", min_size=1, max_size=4)


@st.composite
def regexes(draw):
    parts = draw(st.lists(st.one_of(
        st.builds(lambda ws: "(" + "|".join(re.escape(w) for w in ws) + ")", st.lists(_word, min_size=2, max_size=3,
                                                                                       unique=True)),
        st.builds(lambda lo, span: f"[0-9]{{{lo},{lo + span}}}", st.integers(1, 2), st.integers(0, 2)),
        st.builds(re.escape, _word),
        st.just(r"[A-Z][a-z]{0,3}"),
    ), min_size=1, max_size=4))
    return draw(st.sampled_from([" ", "-", ""])).join(parts)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(regex=regexes(), seed=st.integers(0, 2**16))
def test_property_random_regexes_always_match(engine, regex, seed):
    out = engine.generate(PROMPT, _sp(regex=regex, seed=seed))
    assert out["meta_info"]["finish_reason"]["type"] == "stop"
    assert re.fullmatch(regex, out["text"]), (regex, out["text"])


CHARACTER_REGEX = (
    r"""\{\n"""
    r"""    "name": "[\w\d\s]{1,16}",\n"""
    r"""    "house": "(Gryffindor|Slytherin|Ravenclaw|Hufflepuff)",\n"""
    r"""    "blood status": "(Pure-blood|Half-blood|Muggle-born)",\n"""
    r"""    "occupation": "(student|teacher|auror|ministry of magic|death eater|order of the phoenix)",\n"""
    r"""    "wand": \{\n"""
    r"""        "wood": "[\w\d\s]{1,16}",\n"""
    r"""        "core": "[\w\d\s]{1,16}",\n"""
    r"""        "length": [0-9]{1,2}\.[0-9]{0,2}\n"""
    r"""    \},\n"""
    r"""    "alive": "(Alive|Deceased)",\n"""
    r"""    "patronus": "[\w\d\s]{1,16}",\n"""
    r"""    "bogart": "[\w\d\s]{1,16}"\n"""
    r"""\}"""
)


@pytest.fixture(scope="module")
def off_engine():
    """The exact engine's twin without jump-forward (its outputs, like the exact engine's, do not depend on what
    its cache holds, so the tests below share one)."""
    from sgnb.engine import Engine

    with Engine("smollm2", disable_jump_forward=True, quantization="none") as eng:
        yield eng


def test_jump_forward_saves_decode_steps(engine, off_engine):
    prompt = "Harry Potter is a wizard. Describe him in JSON.\n"
    sp = {"max_new_tokens": 200, "temperature": 0, "regex": CHARACTER_REGEX}
    on = engine.generate(prompt, sp)
    off = off_engine.generate(prompt, sp)
    for o in (on, off):
        assert re.fullmatch(CHARACTER_REGEX, o["text"]), o["text"]
    m_on, m_off = on["meta_info"], off["meta_info"]
    assert m_off["forced_tokens"] == 0 and m_off["decode_steps"] == m_off["completion_tokens"]
    assert m_on["forced_tokens"] > 0
    assert m_on["decode_steps"] * 2 <= m_off["decode_steps"], (m_on["decode_steps"], m_off["decode_steps"])
    forced = m_on["output_forced"]
    assert len(forced) == m_on["completion_tokens"] and sum(forced) == m_on["forced_tokens"]


@pytest.mark.parametrize("regex", [r"The answer is (yes|no)\.", r"Capital: (Paris|Berlin|Rome)!",
                                   r"\{\"ok\": (true|false)\}", CHARACTER_REGEX])
def test_jump_forward_changes_outputs_only_through_tokenization(engine, off_engine, regex):
    """Greedy with and without jump-forward: the token sequences may only part where jump-forward wrote a
    forced token. Jump-forward writes the canonical tokenization of the forced text; a model decoding one
    step at a time under the mask may take another token path for the same text (e.g. '{"' vs '{' '"'),
    which changes the context and so possibly what follows. Where the paths agree, outputs are equal."""
    prompt = "Is water wet? Reply in the format.\n"
    sp = {"max_new_tokens": 200, "temperature": 0, "regex": regex}
    on = engine.generate(prompt, sp)
    off = off_engine.generate(prompt, sp)
    assert re.fullmatch(regex, on["text"]) and re.fullmatch(regex, off["text"])
    a, b, forced = on["output_ids"], off["output_ids"], on["meta_info"]["output_forced"]
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if first is None:
        assert on["text"] == off["text"]
    else:
        assert forced[first], f"outputs part at sampled token {first}: jump-forward changed a model choice"
    assert on["meta_info"]["decode_steps"] < off["meta_info"]["decode_steps"]


def test_identical_constraints_compile_once(engine):
    backend = engine.grammar_backend()
    regex = r"(alpha|beta|gamma) [0-9]{2}"
    before = backend.compile_count
    outs = engine.generate([PROMPT] * 8, _sp(regex=regex, max_new_tokens=12))
    assert all(re.fullmatch(regex, o["text"]) for o in outs)
    assert backend.compile_count == before + 1
    engine.generate(PROMPT, _sp(regex=regex))
    assert backend.compile_count == before + 1


@pytest.mark.parametrize(("kw", "match"), [
    ({"regex": "(unclosed"}, "invalid regex"),
    ({"json_schema": "{not json"}, "json_schema"),
    ({"json_schema": "[1, 2]"}, "JSON object"),
    ({"ebnf": "root ::= missing_rule"}, "invalid ebnf"),
    ({"regex": "a", "json_schema": "{}"}, "at most one"),
])
def test_bad_constraints_fail_before_model_work(engine, kw, match):
    before = engine.get_stats()["prompt_tokens"]
    with pytest.raises(ValueError, match=match):
        engine.generate(PROMPT, {"max_new_tokens": 4, **kw})
    assert engine.get_stats()["prompt_tokens"] == before
    assert engine.generate(PROMPT, {"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2


def test_constrained_and_free_requests_share_a_batch(engine):
    outs = engine.generate([PROMPT, PROMPT, "Once upon a time"], [_sp(regex=r"[0-9]{4}", seed=1),
                                                                  _sp(json_schema=json.dumps(SCHEMAS[0]), seed=2),
                                                                  {"max_new_tokens": 8, "ignore_eos": True}])
    assert re.fullmatch(r"[0-9]{4}", outs[0]["text"])
    jsonschema.validate(json.loads(outs[1]["text"]), SCHEMAS[0])
    assert outs[2]["meta_info"]["completion_tokens"] == 8


def test_ebnf_grammar(engine):
    grammar = 'root ::= expr\nexpr ::= term ("+" term)*\nterm ::= [1-9] | "(" expr ")"'
    out = engine.generate("Arithmetic:", _sp(ebnf=grammar, seed=5, max_new_tokens=40))
    assert out["meta_info"]["finish_reason"]["type"] in ("stop", "length")
    assert re.fullmatch(r"[0-9+()]+", out["text"])


@pytest.mark.parametrize("regex, budget", [(r'"[a-z ]*"', 3), (r'"[\w\d ]*"', 6), (r'\{"n": [0-9]+\}', 7)])
def test_the_budgets_last_token_closes_the_value(engine, regex, budget):
    """A constrained gen that runs into max_new_tokens one token short of a complete match closes it with that
    token (a string gets its quote) instead of stopping mid-value; ignore_eos keeps every sample going to the
    budget, so each one is cut there and must still be a whole match."""
    outs = engine.generate([PROMPT] * 4, [_sp(regex=regex, seed=s, max_new_tokens=budget, ignore_eos=True)
                                          for s in range(4)])
    for o in outs:
        assert o["meta_info"]["completion_tokens"] <= budget
        assert re.fullmatch(regex, o["text"]), (regex, o["text"])


def test_warm_up_builds_the_grammar_compiler_ahead_of_the_first_constrained_request():
    """An engine that warms up (CUDA's default; forced here) builds xgrammar's tables in the background, so the
    first regex request does not wait for them; one that does not builds them on first use. Both constrain."""
    import time

    from sgnb.engine import Engine

    with Engine("dummy:tiny", warmup=True) as eng:
        deadline = time.monotonic() + 60
        while eng._grammar_backend is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert eng._grammar_backend is not None, "the warm-up did not build the grammar compiler"
        out = eng.generate(PROMPT, {"max_new_tokens": 8, "temperature": 1.0, "regex": r"(yes|no)"})
        assert re.fullmatch(r"(yes|no)", out["text"])
    with Engine("dummy:tiny", warmup=False) as eng:
        time.sleep(0.5)
        assert eng._grammar_backend is None  # unconstrained work never loads it
        out = eng.generate(PROMPT, {"max_new_tokens": 8, "temperature": 1.0, "regex": r"(yes|no)"})
        assert re.fullmatch(r"(yes|no)", out["text"]) and eng._grammar_backend is not None
