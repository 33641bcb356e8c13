"""ForwardBatch.build: the device views' contents, and their 16-byte alignment whatever the batch's shape (Triton
compiles a kernel variant per pointer alignment: a view whose alignment followed T's or B's parity compiled new
variants inside programs' timings)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from sgnb.engine.forward_batch import BatchSpec, ForwardBatch, ForwardMode


def _spec(prefix: list[int], extend: list[int], seed: int) -> BatchSpec:
    rng = np.random.default_rng(seed)
    T = sum(extend)
    return BatchSpec(input_ids=rng.integers(0, 1000, T).tolist(), out_cache_loc=np.arange(T, dtype=np.int64) + 7,
                     req_pool_indices=rng.permutation(len(extend)).tolist(), prefix_lens=prefix, extend_lens=extend)


@pytest.mark.parametrize("B,extra", list(itertools.product([1, 2, 3, 5, 8], [0, 1, 4, 7])))
def test_views_hold_the_batch_and_start_16_byte_aligned(B: int, extra: int) -> None:
    rng = np.random.default_rng(B * 10 + extra)
    prefix = rng.integers(0, 50, B).tolist()
    extend = [1] * B if extra == 0 else (1 + rng.integers(0, extra + 1, B)).tolist()
    spec = _spec(prefix, extend, B + extra)
    fb = ForwardBatch.build(spec, torch.zeros(8, 64, dtype=torch.int64), torch.device("cpu"))
    T = sum(extend)
    assert fb.mode is (ForwardMode.DECODE if T == B else ForwardMode.EXTEND)
    views = {"input_ids": fb.input_ids, "positions": fb.positions, "req_pool_indices": fb.req_pool_indices,
             "prefix_lens": fb.prefix_lens, "seq_lens": fb.seq_lens, "qo_indptr": fb.qo_indptr,
             "out_cache_loc": fb.out_cache_loc}
    for name, v in views.items():
        assert v.dtype == torch.int64 and v.is_contiguous(), name
        assert (v.storage_offset() * v.element_size()) % 16 == 0, (name, T, B, v.storage_offset())
    assert fb.input_ids.tolist() == spec.input_ids
    assert fb.out_cache_loc.tolist() == spec.out_cache_loc.tolist()
    assert fb.req_pool_indices.tolist() == spec.req_pool_indices
    assert fb.prefix_lens.tolist() == prefix
    assert fb.seq_lens.tolist() == [p + e for p, e in zip(prefix, extend)]
    assert fb.qo_indptr.tolist() == [0, *np.cumsum(extend).tolist()]
    expected_pos = [p + j for p, e in zip(prefix, extend) for j in range(e)]
    assert fb.positions.tolist() == expected_pos
