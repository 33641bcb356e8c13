"""Choice scoring for `select`: turn per-token logprobs of each choice into a decision."""

from __future__ import annotations

SCORING_METHODS = ("token_length_normalized", "greedy_token_selection", "unconditional_likelihood_normalized")


def check_choices(choices: list[str], method: str) -> None:
    """The validation every scorer (the engine, the HTTP and OpenAI backends) applies before any work."""
    if method not in SCORING_METHODS:
        raise ValueError(f"choices_method must be one of {SCORING_METHODS}, got {method!r}")
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError("choices must be a non-empty list of non-empty strings")


def score_start(prefix_ids: list[int], full: list[list[int]]) -> int:
    """The first position scored for every choice: where any choice's tokenization (prefix + choice, encoded
    together) departs from the prefix's, since a choice may merge with the prefix's last token; at least 1 and
    leaving every choice at least one token."""
    from sgnb.engine.radix_cache import common_prefix_len  # torch: only callers that hold token ids get here

    start = min(common_prefix_len(prefix_ids, f) for f in full)
    return max(1, min(start, min(len(f) for f in full) - 1))


def choose(method: str, cond: list[list[float]], uncond: list[list[float]] | None = None) -> tuple[int, list[float]]:
    """Returns (index of the chosen choice, one normalized score per choice).

    - token_length_normalized: mean logprob of the choice's tokens.
    - greedy_token_selection: compare choices token by token (highest first-token logprob wins, ties go to
      the next token); a shorter choice is padded with its own mean so a prefix choice can still compete.
    - unconditional_likelihood_normalized: mean of (logprob given the prefix - logprob without it), which
      discounts choices that are likely anyway.
    """
    means = [sum(c) / len(c) for c in cond]
    if method == "token_length_normalized":
        return max(range(len(cond)), key=lambda i: (means[i], -i)), means
    if method == "greedy_token_selection":
        width = max(len(c) for c in cond)
        rows = [c + [means[i]] * (width - len(c)) for i, c in enumerate(cond)]
        alive = list(range(len(rows)))
        for col in range(width):
            best = max(rows[i][col] for i in alive)
            alive = [i for i in alive if rows[i][col] == best]
            if len(alive) == 1:
                break
        return alive[0], means
    if method == "unconditional_likelihood_normalized":
        assert uncond is not None and len(uncond) == len(cond)
        scores = [(sum(c) - sum(u)) / len(c) for c, u in zip(cond, uncond)]
        return max(range(len(cond)), key=lambda i: (scores[i], -i)), scores
    raise ValueError(f"unknown choices_method {method!r}; valid: {SCORING_METHODS}")
