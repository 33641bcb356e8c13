"""GenParams: what a `gen` asks for, in the engine's parameter names, with None meaning "inherit the program
default". Validation goes through the engine's SamplingParams, the one definition of sampling values: their
names, types, defaults and valid ranges.

Where values are checked: each gen()'s and run()'s own values at their line (GenParams.build, so a bad value
fails where it was written); a gen's values over its program's, together, once, by the backend that sends them
(the in-process one: `engine.sampling_params`, whose SamplingParams the engine's request keeps as it is). A
constraint's grammar is parsed once per source (engine/grammar.py's validate_constraint).

The frontends spell a few of those names their own way; each spelling is written once, here, and the call sites
(gen(), run()/run_batch(), the server's OpenAI routes, the OpenAI and Anthropic backends) derive theirs from it.
gen()'s and run()'s keyword signatures stay written out for editors and `help()`; tests/lang/test_sampling_names.py
fails when one drifts from GenParams, SamplingParams or these tables.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from sgnb.engine.sampling_params import SamplingParams

# fields of gen() that are not sampling values: how the result is reported (SGLang's /generate fields beside
# sampling_params)
REPORTING = ("return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs")

# the engine's default for each sampling value: what "not sent" means on every backend
SAMPLING_DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(SamplingParams)}

# gen()'s keywords where SGLang's frontend names a field differently (gen(max_tokens=...) sets max_new_tokens)
GEN_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "ebnf": "grammar"}

# the OpenAI API's names where they differ (what `sgnb serve`'s /v1 routes read, what the OpenAI backend sends)
OPENAI_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}
# the sampling values OpenAI's own API defines; the others are SGLang's extensions to it, which OpenAI-compatible
# servers (sgnb serve, SGLang, vLLM) take and OpenAI does not
OPENAI_STANDARD = ("max_new_tokens", "n", "stop", "temperature", "top_p", "frequency_penalty", "presence_penalty",
                   "seed")


@dataclass(frozen=True)
class GenParams:
    """SamplingParams' per-request fields, each optional (None: the program's default), and REPORTING's.
    Written out (not generated) so that type checkers know them; the tests check them against SamplingParams.
    Copy with dataclasses.replace or merged()."""

    max_new_tokens: int | None = None
    min_new_tokens: int | None = None
    n: int | None = None
    stop: tuple[str, ...] | None = None
    stop_token_ids: tuple[int, ...] | None = None
    stop_regex: tuple[str, ...] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    # the constraint applies from this text on (a reasoning format's closing marker): set by the interpreter for
    # a tool call after the reasoning, not a gen() keyword
    grammar_after: str | None = None
    return_logprob: bool | None = None
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    return_text_in_logprobs: bool | None = None

    @classmethod
    def build(cls, **values: Any) -> GenParams:
        """Normalize and validate the explicitly given values (ValueError/TypeError at the caller's line)."""
        values = {k: v for k, v in values.items() if v is not None}
        for key in ("stop", "stop_regex"):
            if isinstance(values.get(key), str):
                values[key] = (values[key],)
            elif key in values:
                values[key] = tuple(values[key])
        if "stop_token_ids" in values:
            values["stop_token_ids"] = tuple(values["stop_token_ids"])
        if "json_schema" in values and not isinstance(values["json_schema"], str):
            values["json_schema"] = _schema_to_str(values["json_schema"])
        params = cls(**values)
        for kind in ("regex", "json_schema", "ebnf"):
            source = getattr(params, kind)
            if source is not None:  # an invalid constraint fails at the gen() line, with the parser's message
                from sgnb.engine.grammar import validate_constraint

                validate_constraint(kind, source)
        sampling = params.sampling_dict()
        sampling.setdefault("max_new_tokens", max(sampling.get("min_new_tokens", 0), 1))
        SamplingParams.from_dict(sampling)  # raises on a bad value
        if params.top_logprobs_num is not None and params.top_logprobs_num < 0:
            raise ValueError("top_logprobs_num must be >= 0")
        return params

    def merged(self, defaults: GenParams) -> GenParams:
        """This gen's values over the program defaults."""
        return dataclasses.replace(defaults, **{k: v for k, v in self.values().items() if v is not None})

    def sampling_dict(self) -> dict[str, Any]:
        """Engine sampling_params (SGLang names) of the values that are set."""
        return {k: v for k, v in self.values().items() if v is not None and k not in REPORTING}

    def values(self) -> dict[str, Any]:
        """Every field by name, None included. Shallow: the values are immutable (build() makes the sequences
        tuples), and dataclasses.asdict's deep copy of each cost ~16 us a call, four calls a gen."""
        return {name: getattr(self, name) for name in _GEN_FIELDS}

    @classmethod
    def from_keywords(cls, keywords: dict[str, Any], names: dict[str, str] | None = None) -> GenParams:
        """build() from a call's keyword arguments (gen()'s, run()'s: pass `dict(locals())`): each field from
        the keyword `names` gives it (default: the field's own name); other keywords are not looked at."""
        names = names or {}
        return cls.build(**{name: keywords.get(names.get(name, name)) for name in _GEN_FIELDS})


_GEN_FIELDS = tuple(f.name for f in dataclasses.fields(GenParams))


def _schema_to_str(schema: Any) -> str:
    import json

    if isinstance(schema, dict):
        return json.dumps(schema)
    if isinstance(schema, type) and hasattr(schema, "model_json_schema"):  # a pydantic model class
        return json.dumps(schema.model_json_schema())
    raise TypeError(f"json_schema must be a JSON string, a dict or a pydantic model class, got {type(schema).__name__}")


# a program's defaults: run()'s and run_batch()'s keyword defaults (SGLang's), which a gen's values override
DEFAULT_PARAMS = GenParams(max_new_tokens=128, n=1, temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0,
                           frequency_penalty=0.0, presence_penalty=0.0, ignore_eos=False)

SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(GenParams) if f.name not in REPORTING)
"""GenParams' sampling values: the SamplingParams fields a gen can set (tests check that they are)."""
