"""sglang.lang.choices: the three select methods (sgnb names them by strings; SGLang's objects work too)."""

from sgnb.primitives import (
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)

__all__ = ["greedy_token_selection", "token_length_normalized", "unconditional_likelihood_normalized"]
