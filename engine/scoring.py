"""Choice scoring for `select`, computed as SGLang's frontend computes it (sglang 0.5.23:
`RuntimeEndpoint.select` in sglang/lang/backend/runtime_endpoint.py and the methods of sglang/lang/choices.py), so
the in-process engine, `RuntimeEndpoint` (against `sgnb serve` or an SGLang server) and `OpenAI` completion models
give the same numbers and pick the same choice as SGLang does.

The method, per choice c of a prefix (text) of `prompt_len` tokens (its image tokens counted):

1. The choice's request is prefix + c, tokenized together (c may merge with the prefix's last token: token
   healing). Its input logprobs start at `logprob_start_len = max(prompt_len - 2, 0)` (`start_len`): entries
   (logprob, token id, token text) for tokens logprob_start_len .. end. The first entry has no logprob (None:
   SGLang's server gives none at logprob_start_len), so the entries hold the logprob of the prefix's last token
   (as it reads in prefix + c) and of every token of c.
2. `normalized_prompt_logprobs[c]` = the mean of the entries' logprobs that are not None.
3. When the prefix text ends with the first entry's token text, that entry is dropped from the choice's
   `input_token_logprobs` (SGLang's "no token healing occurred" case; the mean stays as it is: the entry held
   no logprob).
4. The decision (`decide`):
   - token_length_normalized: the highest normalized_prompt_logprobs (the first on a tie).
   - greedy_token_selection: a matrix of each choice's logprobs (those not None), a shorter row padded with its
     own mean; column by column only the choices at that column's maximum stay; the first left wins
     (meta: greedy_logprob_matrix).
   - unconditional_likelihood_normalized: the token ids of each choice's entries are scored again alone, from
     their first token (whose logprob is None, counted as 0); the score is the mean, over the entries with a
     logprob, of (logprob - unconditional logprob) (meta: unconditional_token_logprobs,
     normalized_unconditional_prompt_logprobs).

Where sglang 0.5.23 crashes on its own server's output, this follows what its code means: its step 3 subtracts
the dropped entry's logprob, which is None (a TypeError), and greedy / unconditional take the None of the first
entry as a number (a TypeError too); its unconditional request sets no logprob_start_len, so its server returns no
input logprobs at all (an IndexError) where the code expects them from the first token. It also keeps only
truthy logprobs for the mean (`if x[0]`), which drops a logprob of exactly 0.0 as well; here only None is left out.
Step 3 looks like it was meant to drop the prefix's last token when the choice did not merge with it (the entries
once began a token later, with no None); on SGLang's current server it looks at the token before, so in practice
the prefix's last token is averaged in, and that is what SGLang computes and what is reproduced here.

One more step, not SGLang's: a token that several choices hold at the same position after the same tokens (the
prefix's last one, typically) gets one logprob, the first such choice's. Each request computes its own copy, and
copies computed in different batches differ in the last bits, which would decide greedy_token_selection's exact
comparison by noise.
"""

from __future__ import annotations

from typing import Any

from sgnb.engine.meta_info import MetaInfo

SCORING_METHODS = ("token_length_normalized", "greedy_token_selection", "unconditional_likelihood_normalized")

Entry = tuple  # (logprob or None, token id or None, token text or None), as SGLang's input_token_logprobs


def check_choices(choices: list[str], method: str) -> None:
    """The validation every scorer (the engine, the HTTP and OpenAI backends) applies before any work."""
    if method not in SCORING_METHODS:
        raise ValueError(f"choices_method must be one of {SCORING_METHODS}, got {method!r}")
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError("choices must be a non-empty list of non-empty strings")


def start_len(prompt_len: int) -> int:
    """SGLang's logprob_start_len for a select over a prefix of prompt_len tokens."""
    return max(prompt_len - 2, 0)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def choice_rows(prefix: str, rows: list[list[Any]], choices: list[str]) -> tuple[list[list[Entry]], list[float]]:
    """Steps 1-3 for every choice. rows[i]: choice i's input logprob entries from start_len (the first entry's
    logprob is ignored: SGLang's server gives None there, sgnb's engine a number). Returns (input_token_logprobs,
    normalized_prompt_logprobs). ValueError for a choice that leaves no token with a logprob."""
    out, normalized = [], []
    shared: dict[tuple, Any] = {}
    for row, choice in zip(rows, choices):
        if not row:
            raise ValueError(f"select: the choice {choice!r} leaves no token to score after the prefix")
        row = [(None, *tuple(row[0])[1:])] + [tuple(e) for e in row[1:]]
        # a token that several choices hold at the same position after the same tokens (the prefix's last one,
        # unless a choice merged with it) has one logprob: the first such choice's. Each choice's request
        # computes its own copy, whose last bits depend on the batch; greedy_token_selection compares exactly.
        key: tuple = ()
        for k, e in enumerate(row):
            key += (e[1] if e[1] is not None else e[2],)
            row[k] = (shared.setdefault(key, e[0]), *e[1:])
        values = [e[0] for e in row if e[0] is not None]
        if not values:
            raise ValueError(f"select: the choice {choice!r} leaves no token with a logprob to score (prefix + "
                             "choice tokenize to too few tokens)")
        if heals(prefix, row[0][2]) and len(row) > 1:
            row = row[1:]
        out.append(row)
        normalized.append(_mean(values))
    return out, normalized


def heals(prefix: str, first_text: str | None) -> bool:
    """Step 3's test on a choice's first entry (its token text): True when that entry is dropped."""
    return isinstance(first_text, str) and prefix.endswith(first_text)


def unexpanded_index(k: int, spans: list[tuple[int, int]]) -> int:
    """Position k of a prompt whose images are expanded (spans: (offset, token count) of each image, in order) as
    a position of the prompt with one token per image; a position inside an image is that image's token."""
    shift = 0
    for offset, count in spans:
        if offset + count <= k:
            shift += count - 1
        elif offset <= k:
            return offset - shift
    return k - shift


def decide(method: str, normalized: list[float], rows: list[list[Entry]],
           uncond_rows: list[list[Any]] | None = None) -> tuple[int, MetaInfo]:
    """Step 4: (index of the chosen choice, SGLang's meta_info for the method). uncond_rows (the unconditional
    method only): per choice, the entries of its token ids scored alone from their first token."""
    meta: MetaInfo = {"normalized_prompt_logprobs": normalized, "input_token_logprobs": rows}
    if method == "token_length_normalized":
        return _argmax(normalized), meta
    if method == "greedy_token_selection":
        values = [[e[0] for e in row if e[0] is not None] for row in rows]
        width = max(len(v) for v in values)
        matrix = [v + [_mean(v)] * (width - len(v)) for v in values]
        alive = list(range(len(matrix)))
        for col in range(width):
            best = max(matrix[i][col] for i in alive)
            alive = [i for i in alive if matrix[i][col] == best]
            if len(alive) == 1:
                break
        meta["greedy_logprob_matrix"] = matrix
        return alive[0], meta
    if method == "unconditional_likelihood_normalized":
        if uncond_rows is None or len(uncond_rows) != len(rows):
            raise ValueError("unconditional_likelihood_normalized needs the unconditional logprobs of every choice")
        scores = []
        for row, alone in zip(rows, uncond_rows):
            alone = [tuple(e) for e in alone]
            if len(alone) != len(row):  # a text API re-tokenized the choice alone: align the two from the end
                alone = ([(None,)] * len(row) + alone)[-len(row):]
            diffs = [e[0] - (u[0] or 0.0) for e, u in zip(row, alone) if e[0] is not None]
            scores.append(_mean(diffs))
        meta["unconditional_token_logprobs"] = uncond_rows
        meta["normalized_unconditional_prompt_logprobs"] = scores
        return _argmax(scores), meta
    raise ValueError(f"unknown choices_method {method!r}; valid: {SCORING_METHODS}")


def _argmax(values: list[float]) -> int:
    return max(range(len(values)), key=lambda i: (values[i], -i))
