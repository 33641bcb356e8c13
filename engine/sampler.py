"""Sampler: logits of the next token -> chosen token ids (+ logprobs), per-request parameters, batched.

Order: penalties and min_new_tokens masking edit the logits; logprobs are reported from the raw model
distribution (log_softmax of the unedited logits, like SGLang's default); then greedy rows take the argmax and
the others are scaled by temperature and filtered by top-k, top-p and min-p before drawing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from sgnb.engine.request import Req


class SampleOutput(NamedTuple):
    token_ids: list[int]
    logprobs: list[float] | None  # logprob of each chosen token under the raw distribution
    top_logprobs: list[list[tuple[float, int]]] | None


def apply_penalties(logits: torch.Tensor, reqs: list[Req], eos_ids: tuple[int, ...]) -> None:
    """In place: repetition (prompt + output), frequency and presence (output) penalties; min_new_tokens."""
    for i, req in enumerate(reqs):
        sp = req.sampling
        if sp.repetition_penalty != 1.0:
            V = logits.shape[1]  # image / video pad ids (engine/media.py) are keys, not tokens: skip them
            seen = torch.tensor(sorted(t for t in set(req.fill_ids) if t < V), dtype=torch.int64, device=logits.device)
            vals = logits[i, seen]
            logits[i, seen] = torch.where(vals > 0, vals / sp.repetition_penalty, vals * sp.repetition_penalty)
        if (sp.frequency_penalty or sp.presence_penalty) and req.output_ids:
            ids, counts = torch.tensor(req.output_ids, device=logits.device).unique(return_counts=True)
            logits[i, ids] -= sp.frequency_penalty * counts.to(logits.dtype) + sp.presence_penalty
        if len(req.output_ids) < sp.min_new_tokens and req.grammar is None:  # a grammar decides its own end
            banned = list(sp.stop_token_ids) + ([] if sp.ignore_eos else list(eos_ids))
            if banned:
                logits[i, torch.tensor(banned, device=logits.device)] = float("-inf")


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


def sample(logits: torch.Tensor, reqs: list[Req], eos_ids: tuple[int, ...],
           default_generator: torch.Generator | None,
           apply_mask: Callable[[torch.Tensor], None] | None = None) -> SampleOutput:
    """logits (B, V) float32 for the next token of each request. Mutates logits. `apply_mask` masks the
    rows of constrained requests (grammar bitmask); reported logprobs are then those of the constrained
    distribution."""
    B, V = logits.shape
    assert B == len(reqs)
    apply_penalties(logits, reqs, eos_ids)
    if apply_mask is not None:
        apply_mask(logits)
    want_lp = any(r.return_logprob for r in reqs)
    logprobs_all = logits.log_softmax(-1) if want_lp else None  # (B, V)

    chosen = torch.empty(B, dtype=torch.int64, device=logits.device)
    greedy = [i for i, r in enumerate(reqs) if r.sampling.greedy]
    sampled = [i for i, r in enumerate(reqs) if not r.sampling.greedy]
    if greedy:
        chosen[greedy] = logits[greedy].argmax(-1)
    if sampled:
        sub = logits[sampled]
        sp = [reqs[i].sampling for i in sampled]
        temps = torch.tensor([s.temperature for s in sp], device=logits.device).unsqueeze(1)
        sub = sub / temps
        top_k = torch.tensor([s.top_k if s.top_k > 0 else V for s in sp], device=logits.device)
        top_p = torch.tensor([s.top_p for s in sp], device=logits.device)
        min_p = torch.tensor([s.min_p for s in sp], device=logits.device)
        if (top_k < V).any() or (top_p < 1.0).any() or (min_p > 0).any():
            sub = _filter(sub, top_k, top_p, min_p)
        probs = sub.softmax(-1)
        for row, i in enumerate(sampled):
            gen = reqs[i].generator or default_generator
            chosen[i] = torch.multinomial(probs[row], 1, generator=gen)[0]

    ids = chosen.tolist()
    token_lp, top = None, None
    if logprobs_all is not None:
        token_lp = logprobs_all.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
        k = max(r.top_logprobs_num for r in reqs)
        if k > 0:
            vals, idx = logprobs_all.topk(k, dim=-1)
            top = [list(zip(v[: r.top_logprobs_num], t[: r.top_logprobs_num]))
                   for v, t, r in zip(vals.tolist(), idx.tolist(), reqs)]
    return SampleOutput(ids, token_lp, top)
