"""MetaInfo: the keys a request's `meta_info` may hold, defined once (no torch: the language and the server import it).

A gen's meta_info (and a select's) is a plain dict, as SGLang's: `Engine.generate` builds it (`Engine._result` for a
finished request, `Engine._partial_meta` for a stream chunk), the remote backends build theirs from their API's
answer, the interpreter adds `tool_calls` / `samples`, and the server sends the engine's on. The TypedDicts below
say which keys it may have. Every key is optional (a stream chunk's has counts only, a hosted API's no timings), so
readers `.get()` them; only the in-process engine's finished result always holds `FINISHED_KEYS`.

Units: token counts are tokens (an image's or video's pad tokens included); times are seconds on the engine's clock,
from the request's arrival at the engine. A logprob entry is `(logprob, token id, token text)`: the logprob is None
where there is none (a select's first scored token), the id None where a text API gives no ids, the text None unless
return_text_in_logprobs was set (JSON makes the tuple a list).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal, TypedDict, cast

__all__ = ["FINISHED_KEYS", "FinishReason", "LogprobEntry", "MetaInfo", "meta_subset"]

LogprobEntry = tuple[float | None, int | None, str | None]  # (logprob, token id, token text)


class FinishReason(TypedDict, total=False):
    """Why a request ended (SGLang's shape). `type` is always there (readers still write `(reason or {}).get(...)`)."""

    type: str | None  # "stop", "length" or "abort" (a hosted API's own word where it has another; None: none given)
    matched: int | str | None  # "stop": the stop string or token id that ended it (None: the model's EOS, per an API)
    length: int  # "length": the max_new_tokens (or the output length at the context's end) it reached
    message: str  # "abort": why ("aborted", the error); a "length" at the context's end: "context length reached"


class MetaInfo(TypedDict, total=False):
    """A gen's or a select's meta_info. The engine's keys first; then those of the select path, the interpreter and
    single backends (each group says whose)."""

    # ---- every backend's (an engine stream chunk: id and the three counts) ---------------------------------------
    id: str | None  # the request id the engine (rid) or the API gave it
    prompt_tokens: int  # tokens of the prompt (a select: summed over the choices' scoring requests)
    completion_tokens: int  # tokens generated (so far, in a stream chunk)
    cached_tokens: int  # prompt tokens the radix cache served (a hosted API: its prompt cache hits; a select: summed)
    finish_reason: FinishReason | None  # why it ended; absent (engine) or None (native server) before the last chunk
    # ---- the engine's finished result ----------------------------------------------------------------------------
    e2e_latency: float  # seconds from the request's arrival to its end
    ttft: float  # seconds from the request's arrival to its first output token (absent: it made none)
    decode_steps: int  # model forwards that sampled a token of this request
    forced_tokens: int  # output tokens jump-forward appended (forced by a grammar) instead of sampling them
    output_forced: list[bool]  # per output token, whether it was forced (requests with a grammar only)
    output_tokens: list[tuple[str, bool]]  # per output token: (its text as detokenized, forced); joined: the text
    cached_chars: int  # characters of a text prompt that cached_tokens cover (where the cache hit ends)
    error: str  # "Type: message" of the failure of a request the engine could not finish (finish_reason abort)
    # ---- logprobs (return_logprob) -------------------------------------------------------------------------------
    # a gen's: one LogprobEntry per prompt token from logprob_start_len / per output token; a select's: one list of
    # them per choice (its scored tokens; its output tokens, none)
    input_token_logprobs: list[Any]
    output_token_logprobs: list[Any]
    input_top_logprobs: list[list[LogprobEntry] | None]  # per prompt token, its top_logprobs_num alternatives
    output_top_logprobs: list[list[LogprobEntry] | None]  # per output token, its top_logprobs_num alternatives
    output_token_logprobs_length: int  # SGLang's stream chunks: output logprob entries so far (the native server's)
    # ---- a select's (Engine.score and engine/scoring.py; the same keys from every backend that scores) -----------
    choices: list[str]  # the choices, in order
    normalized_prompt_logprobs: list[float]  # per choice, the mean logprob of its scored tokens
    greedy_logprob_matrix: list[list[float]]  # greedy_token_selection: per choice its logprobs, padded with its mean
    unconditional_token_logprobs: list[Any]  # unconditional_likelihood_normalized: per choice, its tokens alone
    normalized_unconditional_prompt_logprobs: list[float]  # the same: per choice, the mean of logprob - alone's
    temperature: float  # select(temperature > 0): the temperature the choice was drawn at
    choice_probs: list[float]  # select(temperature > 0): each choice's probability in that draw
    # ---- the interpreter's ---------------------------------------------------------------------------------------
    samples: list[MetaInfo]  # gen(n > 1): every sample's meta_info (the dict itself is the first's, plus this key)
    tool_calls: list[dict[str, Any]]  # gen(tools=...): the calls it made, in OpenAI's shape ([] for a text reply)
    # ---- one backend's -------------------------------------------------------------------------------------------
    speculative: Literal["hit", "call"]  # OpenAI speculative execution: served from the kept continuation, or a call
    stop_reason: str | None  # Anthropic: the API's stop_reason as it said it


# what the in-process engine's finished result always holds (Engine._result; tests check it against MetaInfo)
FINISHED_KEYS = frozenset({"id", "prompt_tokens", "completion_tokens", "cached_tokens", "finish_reason",
                           "e2e_latency", "decode_steps", "forced_tokens", "output_tokens"})


def meta_subset(meta: MetaInfo, keys: Iterable[str]) -> MetaInfo:
    """The items of `meta` under `keys`, in the keys' order: a new dict whose values are `meta`'s (not copied)."""
    items = cast("dict[str, Any]", meta)
    return cast(MetaInfo, {k: items[k] for k in keys if k in items})
