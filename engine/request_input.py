"""One generate request as a caller gives it, normalized once: what `Engine.generate` / `async_generate` /
`score` and the HTTP server share (SGLang's GenerateReqInput conventions).

A request holds one prompt or a batch (a list of texts, or a list of id lists). Every per-prompt argument is a
single value for all prompts or a list with one entry per prompt; `prompts()` resolves them into one
`PromptInput` each. A prompt with n samples becomes n engine requests named `sample_rids(rid, n)` and seeded
`sample_seed(seed, j)`; `split_samples` gives their n=1 sampling dicts (the server streams each on its own).
Torch-free: the server imports it.
"""

from __future__ import annotations

import itertools
import uuid
from dataclasses import dataclass
from typing import Any, overload

# a request id unique in this process and across processes: a random prefix drawn once, then a counter (uuid4 per
# request read os.urandom each time: ~2.4 us, ~1,500 times a hellaswag run of the GPU suite, all holding the GIL)
_RID_PREFIX = uuid.uuid4().hex[:8]
_rid_counter = itertools.count()


def new_rid() -> str:
    """A fresh request id (thread-safe: `next` on an itertools.count is atomic under the GIL)."""
    return f"{_RID_PREFIX}{next(_rid_counter):x}"


@dataclass
class PromptInput:
    """One prompt of a request, with its own values (not yet validated: the engine does that)."""

    prompt: str | None
    input_ids: list[int] | None
    sampling_params: Any  # a dict (validated by the engine) or a SamplingParams (validated before), or None
    return_logprob: Any
    logprob_start_len: Any
    top_logprobs_num: Any
    rid: str | None
    image_data: Any
    video_data: Any


@dataclass
class GenerateInput:
    """The arguments of a generate call (Engine.generate's names)."""

    prompt: Any = None  # str or list[str]
    input_ids: Any = None  # list[int] or list[list[int]]
    sampling_params: Any = None  # a dict or SamplingParams, or one per prompt
    return_logprob: Any = False
    logprob_start_len: Any = -1
    top_logprobs_num: Any = 0
    rid: Any = None  # str for one prompt, one per prompt for a batch
    image_data: Any = None  # for one prompt an item or a list; for a batch one entry per prompt
    video_data: Any = None

    @property
    def batched(self) -> bool:
        ids = self.input_ids
        return isinstance(self.prompt, list) or (isinstance(ids, list) and bool(ids) and isinstance(ids[0], list))

    def prompts(self) -> list[PromptInput]:
        """One PromptInput per prompt. ValueError for an empty batch or a per-prompt list of the wrong length."""
        if not self.batched:
            return [PromptInput(self.prompt, self.input_ids, self.sampling_params, self.return_logprob,
                                self.logprob_start_len, self.top_logprobs_num, self.rid, self.image_data,
                                self.video_data)]
        count = len(self.prompt) if self.prompt is not None else len(self.input_ids)
        if count == 0:
            raise ValueError("an empty batch of prompts")
        texts = list(self.prompt) if self.prompt is not None else [None] * count
        id_lists = list(self.input_ids) if self.input_ids is not None else [None] * count
        if isinstance(self.rid, str):
            raise ValueError("rid must be a list with one id per prompt for a batch")
        columns = {name: per_prompt(getattr(self, name), count, name) for name in
                   ("sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num", "rid")}
        columns.update((name, per_prompt(v, count, name) if v is not None else [None] * count)
                       for name, v in (("image_data", self.image_data), ("video_data", self.video_data)))
        return [PromptInput(texts[i], id_lists[i], **{name: c[i] for name, c in columns.items()})
                for i in range(count)]


def per_prompt(value: Any, count: int, name: str) -> list[Any]:
    """A per-prompt argument: a list holds one entry per prompt, anything else applies to every prompt."""
    if isinstance(value, list):
        if len(value) != count:
            raise ValueError(f"{name} has {len(value)} entries for {count} prompts")
        return value
    return [value] * count


def sample_rids(base: str, n: int) -> list[str]:
    """The engine's names for the n samples of a request named base: base itself, or base-0 .. base-(n-1)."""
    return [base] if n == 1 else [f"{base}-{j}" for j in range(n)]


@overload
def sample_seed(seed: int, j: int) -> int: ...


@overload
def sample_seed(seed: None, j: int) -> None: ...


def sample_seed(seed: int | None, j: int) -> int | None:
    """Sample j of a seeded request draws with seed + j (each sample reproducible on its own)."""
    return None if seed is None else seed + j


def split_samples(params: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """The n=1 sampling dicts of a request's n samples, seeded as the engine seeds them."""
    if n == 1:
        return [params]
    seed = params.get("seed")
    return [{**params, "n": 1, **({"seed": sample_seed(seed, j)} if isinstance(seed, int) else {})}
            for j in range(n)]
