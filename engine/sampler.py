"""Sampler: logits of the next token -> chosen token ids (+ logprobs), per-request parameters, batched.

Order: penalties and min_new_tokens masking edit the logits; logprobs are reported from the raw model
distribution (log_softmax of the unedited logits, like SGLang's default); then greedy rows take the argmax and
the others are scaled by temperature and filtered by top-k, top-p and min-p before drawing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from sgnb.engine.forward_batch import HostCopy, to_device
from sgnb.engine.request import Req


class SampleOutput(NamedTuple):
    token_ids: list[int]
    # logprob of each chosen token under the raw distribution (None: a placeholder, see _sample_one_by_one)
    logprobs: list[float | None] | None
    top_logprobs: list[list[tuple[float, int]] | None] | None


def apply_penalties(logits: torch.Tensor, reqs: list[Req], eos_ids: tuple[int, ...]) -> None:
    """In place: repetition (prompt + output), frequency and presence (output) penalties; min_new_tokens."""
    for i, req in enumerate(reqs):
        sp = req.sampling
        if sp.repetition_penalty != 1.0:
            V = logits.shape[1]  # image / video pad ids (engine/media.py) are keys, not tokens: skip them
            seen = to_device(sorted(t for t in set(req.fill_ids) if t < V), torch.int64, logits.device)
            vals = logits[i, seen]
            logits[i, seen] = torch.where(vals > 0, vals / sp.repetition_penalty, vals * sp.repetition_penalty)
        if (sp.frequency_penalty or sp.presence_penalty) and req.output_ids:
            ids, counts = to_device(req.output_ids, torch.int64, logits.device).unique(return_counts=True)
            logits[i, ids] -= sp.frequency_penalty * counts.to(logits.dtype) + sp.presence_penalty
        if len(req.output_ids) < sp.min_new_tokens and req.grammar is None:  # a grammar decides its own end
            banned = list(sp.stop_token_ids) + ([] if sp.ignore_eos else list(eos_ids))
            if banned:
                logits[i, to_device(banned, torch.int64, logits.device)] = float("-inf")


def _filter(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens outside top-k / top-p / min-p per row. logits (B, V) already temperature-scaled."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # (B, V)
    probs = sorted_logits.softmax(-1)
    ranks = torch.arange(logits.shape[-1], device=logits.device).unsqueeze(0)  # (1, V)
    drop = ranks >= top_k.unsqueeze(1)
    cum_before = probs.cumsum(-1) - probs  # mass strictly above this token
    drop |= cum_before > top_p.unsqueeze(1)
    drop |= probs < (min_p.unsqueeze(1) * probs[:, :1])
    drop[:, 0] = False  # always keep the best token
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of probs (n, V), each drawn from its row's distribution: the inverse of the row's
    cumulative distribution at a uniform point of (0, total]. A token of probability 0 is never drawn (the first
    index whose cumulative sum reaches the point is past every flat stretch). On the CPU this is 14-47x
    torch.multinomial for 8-128 rows of a 49k vocabulary (2-core EPYC, 2026-12-06); on a GPU it is three
    launches for the whole batch."""
    cdf = probs.cumsum(-1)  # (n, V)
    point = (1.0 - torch.rand(cdf.shape[0], 1, generator=generator, device=cdf.device)) * cdf[:, -1:]
    return torch.searchsorted(cdf, point).squeeze(1).clamp_(max=cdf.shape[1] - 1)


class DeviceSample:
    """One sampling step's results on the device, with their copy to the host started at once (pinned
    buffers, non-blocking on CUDA): `to_host()` waits for that copy only, not for whatever the device runs
    after it (the next step's forward, under overlap scheduling)."""

    def __init__(self, chosen: torch.Tensor, token_lp: torch.Tensor | None, top: tuple[torch.Tensor, torch.Tensor] | None,
                 top_nums: list[int]) -> None:
        self.chosen = chosen  # (B,) int64 on the device: the next step's input ids
        self.top_nums = top_nums
        self._copy = HostCopy(chosen, token_lp, *(top if top is not None else (None, None)))

    def to_host(self) -> SampleOutput:
        ids, token_lp, vals, idx = self._copy.lists()
        top: list[list[tuple[float, int]] | None] | None = None
        if vals is not None:
            top = [list(zip(v[:k], t[:k])) for v, t, k in zip(vals, idx, self.top_nums)]
        return SampleOutput(ids, token_lp, top)


def sample(logits: torch.Tensor, reqs: list[Req], eos_ids: tuple[int, ...],
           default_generator: torch.Generator | None,
           apply_mask: Callable[[torch.Tensor], None] | None = None) -> SampleOutput:
    """logits (B, V) float32 for the next token of each request. Mutates logits. `apply_mask` masks the
    rows of constrained requests (grammar bitmask); reported logprobs are then those of the constrained
    distribution."""
    return sample_on_device(logits, reqs, eos_ids, default_generator, apply_mask).to_host()


def sample_on_device(logits: torch.Tensor, reqs: list[Req], eos_ids: tuple[int, ...],
                     default_generator: torch.Generator | None,
                     apply_mask: Callable[[torch.Tensor], None] | None = None) -> DeviceSample:
    """`sample` without waiting for the device: no host sync on the way (every branch is decided from host
    values), the chosen ids stay on the device and their host copy is under way."""
    B, V = logits.shape
    assert B == len(reqs)
    apply_penalties(logits, reqs, eos_ids)
    if apply_mask is not None:
        apply_mask(logits)
    want_lp = any(r.return_logprob for r in reqs)
    logprobs_all = logits.log_softmax(-1) if want_lp else None  # (B, V)

    dev = logits.device
    greedy = [i for i, r in enumerate(reqs) if r.sampling.greedy]
    sampled = [i for i, r in enumerate(reqs) if not r.sampling.greedy]
    chosen = logits.argmax(-1)  # (B,) the greedy rows' answer; sampled rows are overwritten below
    if sampled:
        sub = logits if not greedy else logits[to_device(sampled, torch.int64, dev)]
        sp = [reqs[i].sampling for i in sampled]
        temps = to_device([s.temperature for s in sp], torch.float32, dev).unsqueeze(1)
        sub = sub / temps
        if any(0 < s.top_k < V or s.top_p < 1.0 or s.min_p > 0 for s in sp):
            top_k = to_device([s.top_k if 0 < s.top_k < V else V for s in sp], torch.int64, dev)
            top_p = to_device([s.top_p for s in sp], torch.float32, dev)
            min_p = to_device([s.min_p for s in sp], torch.float32, dev)
            sub = _filter(sub, top_k, top_p, min_p)
        probs = sub.softmax(-1)
        # the rows on the engine's generator draw together (a few launches in all, where two per row were most of
        # a sampled decode step's host time on the GPU); a request with its own seed draws from its own
        shared = [row for row, i in enumerate(sampled) if reqs[i].generator is None]
        if shared:
            every = len(shared) == len(sampled)
            picks = draw(probs if every else probs[to_device(shared, torch.int64, dev)], default_generator)
            rows = sampled if every else [sampled[row] for row in shared]
            chosen[to_device(rows, torch.int64, dev)] = picks
        for row, i in enumerate(sampled):
            gen = reqs[i].generator
            if gen is not None:
                chosen[i] = draw(probs[row: row + 1], gen)[0]

    token_lp, top = None, None
    top_nums = [r.top_logprobs_num for r in reqs]
    if logprobs_all is not None:
        token_lp = logprobs_all.gather(1, chosen.unsqueeze(1)).squeeze(1)
        k = max(top_nums)
        if k > 0:
            top = logprobs_all.topk(k, dim=-1)
    return DeviceSample(chosen, token_lp, (top.values, top.indices) if top is not None else None, top_nums)
