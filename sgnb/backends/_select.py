"""`select` from prompt logprobs fetched over an API (RuntimeEndpoint, OpenAI completion models): the steps both
take around engine/scoring.py's method. The in-process engine runs the same method itself (Engine.score)."""

from __future__ import annotations

from collections.abc import Callable

from sgnb.backends.base import BackendError, ChoiceDecision, GenContext
from sgnb.engine.scoring import Entry, check_choices, choice_rows, decide


def select_by_logprobs(ctx: GenContext, choices: list[str], method: str,
                       conditional: Callable[[], list[list[Entry]]],
                       unconditional: Callable[[list[list[Entry]]], list[list[Entry]]],
                       source: str = "") -> ChoiceDecision:
    """Validate, score and decide. `conditional()`: per choice, the input logprob entries of prefix + choice from
    scoring.start_len (one batch of requests); `unconditional(rows)` (the unconditional method only): per choice,
    the entries of its scored tokens (`rows`, as choice_rows returned them) scored alone. A choice that leaves no
    token to score raises BackendError (`source` appended to its message). meta_info: SGLang's, plus "choices"."""
    check_choices(choices, method)
    if not ctx.text:
        raise BackendError("select needs a non-empty prefix to score choices against")
    entries = conditional()
    try:
        rows, normalized = choice_rows(ctx.text, entries, choices)
    except ValueError as e:
        raise BackendError(f"{e}{source}") from None
    uncond = unconditional(rows) if method == "unconditional_likelihood_normalized" else None
    index, meta = decide(method, normalized, rows, uncond)
    meta["choices"] = list(choices)
    return ChoiceDecision(choices[index], meta)
