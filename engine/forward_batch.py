"""ForwardBatch: what one model forward over a ragged batch of requests needs to know."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sgnb.engine.kv_pool import KVCache


@dataclass
class ForwardBatch:
    """Flat (ragged) batch: the new tokens of every request, concatenated.

    Request i contributes extend_lens[i] tokens at absolute positions prefix_lens[i] ...; the KV of its
    first prefix_lens[i] tokens is already in the pool at req_to_token[req_pool_indices[i]]. The model writes
    the new tokens' K/V at out_cache_loc (which the caller has also written into req_to_token).
    """

    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64
    out_cache_loc: torch.Tensor  # (T,) int64 KV slots of the new tokens
    req_pool_indices: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    req_to_token: torch.Tensor  # (R, max_context)
    kv_cache: KVCache | None = None  # the K/V storage: attached by the runner that runs the batch
    shared_len: int = 0  # leading slots identical for every request (read once: cascade attention)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.extend_lens)
