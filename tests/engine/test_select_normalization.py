"""select's scores as SGLang computes them (engine/scoring.py): Engine.score against an oracle built from HF
transformers' per-token logprobs on the same weights, following SGLang's formula here in the test, and against
SGLang's own select code (sglang.lang, when installed) fed with those logprobs the way SGLang's server sends them."""

from __future__ import annotations

import types

import pytest

TOL = 2e-4  # fp32 logprobs, as tests/engine/test_engine.py

METHODS = ("token_length_normalized", "greedy_token_selection", "unconditional_likelihood_normalized")
CASES = [
    # the mean over the prefix's last token (":") and the choice's picks " yellow"; the choice's tokens alone would
    # pick " dark purple with spots" (a close call decided as SGLang decides it)
    ("Q: What color is a ripe banana?\nA:", [" yellow", " dark purple with spots", " blue"]),
    ("Q: Is the sky blue?\nAnswer:", [" yes", " no", " maybe so"]),
    ("The color of grass is ", ["green", "blue", "reddish"]),  # each choice merges with the trailing space
]
# prefixes whose text ends with the text of the token at logprob_start_len: SGLang drops that entry (its code
# then fails on the entry's None logprob; sgnb drops it, which leaves the mean as it is)
HEALED = [
    ("Hi", [" there", "!"]),  # one prefix token: logprob_start_len 0 is the prefix's own token
    ("ha ha", [" ha", "!"]),  # "ha", " ha": the text ends with the first token's text
]


def _reference(engine, hf_logprobs, prefix: str, choices: list[str], method: str) -> dict:
    """SGLang's select from HF's logprobs, written out here (not with engine/scoring.py)."""
    tok = engine.tokenizer
    start = max(len(tok.encode(prefix)) - 2, 0)
    rows, normalized, fulls, shared = [], [], [], {}
    for c in choices:
        full = tok.encode(prefix + c)
        ref = hf_logprobs(full)
        # SGLang's server: entries for tokens start.., the first without a logprob
        row = [(None, full[start], tok.decode([full[start]], False))]
        for j in range(start + 1, len(full)):
            # one value for a token several choices hold after the same tokens (HF's copies differ in the last bits)
            lp = shared.setdefault(tuple(full[:j + 1]), ref[j - 1, full[j]].item())
            row.append((lp, full[j], tok.decode([full[j]], False)))
        values = [e[0] for e in row if e[0] is not None]
        normalized.append(sum(values) / len(values))
        if prefix.endswith(row[0][2]):
            row = row[1:]
        rows.append(row)
        fulls.append(full)
    out = {"normalized_prompt_logprobs": normalized, "input_token_logprobs": rows}
    if method == "token_length_normalized":
        out["index"] = max(range(len(choices)), key=lambda i: (normalized[i], -i))
    elif method == "greedy_token_selection":
        vals = [[e[0] for e in row if e[0] is not None] for row in rows]
        width = max(map(len, vals))
        matrix = [v + [sum(v) / len(v)] * (width - len(v)) for v in vals]
        alive = list(range(len(choices)))
        for col in range(width):
            top = max(matrix[i][col] for i in alive)
            alive = [i for i in alive if matrix[i][col] == top]
            if len(alive) == 1:
                break
        out["index"], out["greedy_logprob_matrix"] = alive[0], matrix
    else:
        scores, uncond = [], []
        for row in rows:
            ids = [e[1] for e in row]
            ref = hf_logprobs(ids)
            alone = [None] + [ref[j - 1, ids[j]].item() for j in range(1, len(ids))]
            scores.append(sum(e[0] - (u or 0.0) for e, u in zip(row, alone) if e[0] is not None)
                          / sum(e[0] is not None for e in row))
            uncond.append(alone)
        out["index"] = max(range(len(choices)), key=lambda i: (scores[i], -i))
        out["normalized_unconditional_prompt_logprobs"], out["uncond"] = scores, uncond
    return out


def _assert_rows(got: list, want: list) -> None:
    assert len(got) == len(want)
    for g_row, w_row in zip(got, want):
        assert [(e[1], e[2]) for e in g_row] == [(e[1], e[2]) for e in w_row]
        for g, w in zip(g_row, w_row):
            assert (g[0] is None) == (w[0] is None)
            if w[0] is not None:
                assert abs(g[0] - w[0]) < TOL


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("prefix, choices", CASES + HEALED)
def test_engine_scores_select_as_sglang_does(engine, hf_logprobs, prefix, choices, method):
    want = _reference(engine, hf_logprobs, prefix, choices, method)
    res = engine.score(prefix, choices, method, return_text_in_logprobs=True)
    assert res["normalized_prompt_logprobs"] == pytest.approx(want["normalized_prompt_logprobs"], abs=TOL)
    _assert_rows(res["input_token_logprobs"], want["input_token_logprobs"])
    assert res["index"] == want["index"] and res["choice"] == choices[want["index"]]
    if method == "greedy_token_selection":
        assert [len(r) for r in res["greedy_logprob_matrix"]] == [len(r) for r in want["greedy_logprob_matrix"]]
        for g, w in zip(res["greedy_logprob_matrix"], want["greedy_logprob_matrix"]):
            assert g == pytest.approx(w, abs=TOL)
    if method == "unconditional_likelihood_normalized":
        assert res["normalized_unconditional_prompt_logprobs"] == pytest.approx(
            want["normalized_unconditional_prompt_logprobs"], abs=TOL)
        for row, alone in zip(res["unconditional_token_logprobs"], want["uncond"]):
            assert row[0][0] is None and [e[0] for e in row[1:]] == pytest.approx(alone[1:], abs=TOL)
    assert "unconditional_token_logprobs" in res or method != "unconditional_likelihood_normalized"
    assert len(res["output_token_logprobs"]) == len(choices)


def test_the_scored_entries_start_two_tokens_before_the_prefix_end(engine):
    prefix, choices = CASES[0]
    res = engine.score(prefix, choices, return_text_in_logprobs=True)
    ids = engine.tokenizer.encode(prefix)
    for c, row in zip(choices, res["input_token_logprobs"]):
        full = engine.tokenizer.encode(prefix + c)
        assert [e[1] for e in row] == full[len(ids) - 2:]  # the prefix's last two tokens, then the choice's
        assert row[0][0] is None and all(e[0] is not None for e in row[1:])
    plain = engine.score(prefix, choices)  # the same entries, without their texts
    assert [[e[1] for e in row] for row in plain["input_token_logprobs"]] == \
        [[e[1] for e in row] for row in res["input_token_logprobs"]]
    assert all(e[2] is None for row in plain["input_token_logprobs"] for e in row)


def test_a_choice_that_leaves_no_token_to_score_is_refused(engine):
    assert len(engine.tokenizer.encode("the" + "re")) == 1  # "there": the choice swallows the prefix's one token
    with pytest.raises(ValueError, match="leaves no token to score"):
        engine.score("the", ["re", " end"])


# ---- SGLang's own code ------------------------------------------------------------------------------------------
class _HFServer:
    """What SGLang's RuntimeEndpoint.select posts to /generate, answered from HF's logprobs as SGLang's server
    answers: prompt_tokens for the prefix; entries from logprob_start_len with None first, texts decoded per token."""

    def __init__(self, engine, hf_logprobs):
        self.tok, self.hf = engine.tokenizer, hf_logprobs

    def __call__(self, s, data):
        text = data["text"]
        if isinstance(text, str):
            return {"text": "", "meta_info": {"prompt_tokens": len(self.tok.encode(text))}}
        start, outs = data["logprob_start_len"], []
        for t in text:
            ids = self.tok.encode(t)
            ref = self.hf(ids)
            entries = [[None if j == start else ref[j - 1, ids[j]].item(), ids[j], self.tok.decode([ids[j]], False)]
                       for j in range(start, len(ids))]
            outs.append({"text": "", "meta_info": {"input_token_logprobs": entries, "output_token_logprobs": []}})
        return outs


@pytest.mark.parametrize("prefix, choices", CASES)
def test_sglangs_own_select_code_agrees(engine, hf_logprobs, prefix, choices):
    """sglang.lang's RuntimeEndpoint.select and TokenLengthNormalized, unchanged, over HF's logprobs."""
    sglang_rt = pytest.importorskip("sglang.lang.backend.runtime_endpoint", reason="install sglang --no-deps")
    from sglang.lang.choices import token_length_normalized

    endpoint = object.__new__(sglang_rt.RuntimeEndpoint)  # no server: /generate is answered by _HFServer
    endpoint._generate_http_request = _HFServer(engine, hf_logprobs)
    state = types.SimpleNamespace(text_=prefix, images_=[])
    theirs = endpoint.select(state, choices, 0.0, token_length_normalized)
    ours = engine.score(prefix, choices, return_text_in_logprobs=True)
    assert ours["choice"] == theirs.decision
    assert ours["normalized_prompt_logprobs"] == pytest.approx(theirs.meta_info["normalized_prompt_logprobs"],
                                                               abs=TOL)
    _assert_rows(ours["input_token_logprobs"], theirs.meta_info["input_token_logprobs"])
