"""The sampler on its own (engine/sampler.py): draws follow each row's distribution whether rows share the engine's
generator or bring their own seed, greedy rows take the argmax, and a seeded row's draw does not depend on what else
is in the batch."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from sgnb.engine.sampler import sample
from sgnb.engine.sampling_params import SamplingParams


def _req(seed: int | None = None, **values) -> SimpleNamespace:
    sp = SamplingParams.from_dict({"max_new_tokens": 8, **values})
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    return SimpleNamespace(sampling=sp, generator=gen, return_logprob=False, top_logprobs_num=0, fill_ids=[1, 2],
                           output_ids=[], grammar=None)


def test_draws_follow_each_rows_distribution():
    V, n = 6, 4000
    want = torch.tensor([[0.5, 0.3, 0.2, 0, 0, 0], [0, 0, 0, 0.1, 0.1, 0.8], [0.25] * 4 + [0, 0]])
    logits = want.clamp(min=1e-30).log()
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(3, V)
    for step in range(n):
        reqs = [_req(), _req(seed=step), _req()]  # two rows on the shared generator, one on its own
        out = sample(logits.clone(), reqs, (), gen)
        counts[torch.arange(3), torch.tensor(out.token_ids)] += 1
    freq = counts / n
    # 4000 draws: a frequency's standard deviation is <= 0.008, so 0.04 is 5 of them
    torch.testing.assert_close(freq, want, atol=0.04, rtol=0)
    assert (counts[want == 0] == 0).all()  # never a token of probability 0


def test_greedy_rows_take_the_argmax_beside_sampled_ones():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]])
    reqs = [_req(temperature=0.0), _req(), _req(top_k=1)]
    out = sample(logits.clone(), reqs, (), torch.Generator().manual_seed(1))
    assert out.token_ids[0] == 1 and out.token_ids[2] == 2


def test_a_seeded_row_draws_the_same_whatever_shares_its_batch():
    logits = torch.randn(1, 50)
    alone = sample(logits.clone(), [_req(seed=7)], (), torch.Generator().manual_seed(0)).token_ids[0]
    for others in (1, 3, 8):
        batch = torch.cat([torch.randn(others, 50), logits])
        reqs = [_req() for _ in range(others)] + [_req(seed=7)]
        assert sample(batch, reqs, (), torch.Generator().manual_seed(others)).token_ids[-1] == alone
