"""GenParams: what a `gen` asks for, in the engine's parameter names, with None meaning "inherit the program
default". Validation goes through the engine's SamplingParams, the one definition of sampling values."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from sgnb.engine.sampling_params import SamplingParams

# fields of gen() that are not sampling values: how the result is reported
_REPORTING = ("return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs")


@dataclass(frozen=True)
class GenParams:
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
        return dataclasses.replace(defaults, **{k: v for k, v in dataclasses.asdict(self).items() if v is not None})

    def sampling_dict(self) -> dict[str, Any]:
        """Engine sampling_params (SGLang names) of the values that are set."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None and k not in _REPORTING}


def _schema_to_str(schema: Any) -> str:
    import json

    if isinstance(schema, dict):
        return json.dumps(schema)
    if isinstance(schema, type) and hasattr(schema, "model_json_schema"):  # a pydantic model class
        return json.dumps(schema.model_json_schema())
    raise TypeError(f"json_schema must be a JSON string, a dict or a pydantic model class, got {type(schema).__name__}")


DEFAULT_PARAMS = GenParams(max_new_tokens=128, temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0)
