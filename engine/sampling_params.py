"""SamplingParams: the one definition of what a generation request may ask for (SGLang's names)."""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Any

from sgnb.engine.stops import compile_regex as compile_stop_regex

_INTS = ("max_new_tokens", "min_new_tokens", "top_k", "n")
_FLOATS = ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty")
_BOOLS = ("ignore_eos", "skip_special_tokens", "no_stop_trim")
_STRS = ("regex", "json_schema", "ebnf", "grammar_after")


def is_strict_int(v: Any) -> bool:
    """An int and not a bool (True would pass isinstance(v, int)): what int-typed request fields accept."""
    # a plain int first: the ABC check costs ~1 us, and every request checks a dozen values
    return type(v) is int or (isinstance(v, numbers.Integral) and not isinstance(v, bool))


@dataclass(frozen=True)
class SamplingParams:
    """Validated sampling parameters. Build with `SamplingParams.from_dict`, copy with `dataclasses.replace`."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 -> whole vocabulary
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    stop_regex: tuple[str, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    seed: int | None = None
    # structured output (compiled by the grammar backend; validated there)
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    # the grammar applies from the end of the reasoning on: once the output holds this text (the reasoning's
    # closing marker, e.g. "</think>"), not before; set by sgnb serve for a model with a reasoning parser
    grammar_after: str | None = None

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"sampling_params.{name}={getattr(self, name)!r}: {why}")

        # types first, strictly: 2.5 tokens or ignore_eos="yes" is a mistake to report, not a value to coerce
        for name in _INTS:
            if not is_strict_int(getattr(self, name)):
                raise bad(name, "must be an int")
        for name in _FLOATS:
            v = getattr(self, name)
            number = type(v) is float or (isinstance(v, numbers.Real) and not isinstance(v, bool))  # a float first
            if not number or not math.isfinite(v):
                raise bad(name, "must be a finite number")
        for name in _BOOLS:
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be true or false")
        for name in _STRS:
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise bad(name, "must be a string")
        if self.seed is not None and not is_strict_int(self.seed):
            raise bad("seed", "must be an int or null")
        if self.seed is not None and not -(1 << 63) <= self.seed <= (1 << 63) - max(self.n, 1):
            # a generator takes a 64-bit seed; sample j of n draws with seed + j
            raise bad("seed", "must be an int in [-2**63, 2**63 - n] (a 64-bit seed; sample j draws with seed + j)")
        if self.max_new_tokens < 0:
            raise bad("max_new_tokens", "must be >= 0")
        if self.min_new_tokens < 0 or self.min_new_tokens > self.max_new_tokens:
            raise bad("min_new_tokens", "must be in [0, max_new_tokens]")
        if not self.temperature >= 0.0:
            raise bad("temperature", "must be >= 0 (0 means greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            raise bad("top_k", "must be -1 (disabled) or >= 1")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise bad("repetition_penalty", "must be in (0, 2]")
        if self.n < 1:
            raise bad("n", "must be >= 1")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise bad("stop", "stop strings must be non-empty strings")
        if any(not is_strict_int(t) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative ints")
        if any(not isinstance(p, str) or p == "" for p in self.stop_regex):
            raise bad("stop_regex", "stop regexes must be non-empty strings")
        for pattern in self.stop_regex:
            try:
                compile_stop_regex(pattern)
            except ValueError as e:
                raise bad("stop_regex", str(e)) from None
        if sum(x is not None for x in (self.regex, self.json_schema, self.ebnf)) > 1:
            raise ValueError("sampling_params: give at most one of regex, json_schema, ebnf")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1

    @classmethod
    def from_dict(cls, params: dict[str, Any] | None) -> SamplingParams:
        """Validate a user dict. Unknown names raise TypeError naming them; bad values raise ValueError."""
        params = dict(params or {})
        names = _FIELD_NAMES
        unknown = sorted(set(params) - names)
        if unknown:
            raise TypeError(f"unknown sampling parameter(s) {unknown}; valid names: {sorted(names)}")
        for key in ("stop", "stop_regex", "stop_token_ids"):
            value = params.get(key)
            if value is None:
                params.pop(key, None)
            elif isinstance(value, str) and key != "stop_token_ids":
                params[key] = (value,)
            elif isinstance(value, (list, tuple)):
                params[key] = tuple(value)
            elif key == "stop_token_ids" and is_strict_int(value):
                params[key] = (value,)
            else:
                raise ValueError(f"sampling_params.{key}={value!r}: must be "
                                 + ("a list of ints" if key == "stop_token_ids" else "a string or a list of strings"))
        # SGLang accepts None for "use the default" on most fields
        params = {k: v for k, v in params.items() if v is not None or k in ("seed", "regex", "json_schema", "ebnf")}
        if isinstance(params.get("json_schema"), dict):
            import json

            params["json_schema"] = json.dumps(params["json_schema"])
        return cls(**params)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(SamplingParams))


def check_constraint_size(kind: str, source: object, limit: int) -> None:
    """ValueError naming the limit when a regex / json_schema / ebnf source is over `limit` bytes (checked before
    the grammar is parsed or compiled: a compile's time grows with its source)."""
    if not isinstance(source, str):
        return  # the grammar backend words the type error
    size = len(source.encode("utf-8", "surrogatepass"))
    if size > limit:
        raise ValueError(f"{kind}: {size} bytes, over this engine's limit of {limit} for a constraint "
                         "(max_grammar_bytes; sgnb serve --max-grammar-bytes)")
