"""Tensor parallelism: how a Llama-family model is split across ranks, and the collectives the shards need.

`ShardLayout` is pure data (picklable, no torch.distributed): which attention heads, KV heads, MLP columns (and
each expert's MLP columns in a mixture-of-experts model) and vocabulary rows one rank owns. Heads are split by KV group, so each rank's query heads attend only to its own
KV heads and every rank keeps the KV pool of its heads alone:

    9 heads / 3 KV heads, tp=2 -> rank 0: KV heads 0-1, heads 0-5;  rank 1: KV head 2, heads 6-8
    9 heads / 3 KV heads, tp=4 -> ranks 0,1 share KV head 0 (replicated) and split its 3 heads 2 + 1; ...

Uneven sizes are fine everywhere (the first `n % tp` ranks take one more). `TPGroup` wraps the process group:
`all_reduce` after the row-parallel linears (o_proj, down_proj) and the vocab-parallel embedding, `gather_vocab`
to assemble logits on rank 0. At size 1 both are no-ops, so the in-process runner pays nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from sgnb.engine.model_config import ModelConfig

Range = tuple[int, int]  # [start, end)


def even_split(n: int, parts: int, index: int) -> Range:
    """The index-th of `parts` contiguous ranges covering [0, n); the first n % parts are one longer."""
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


@dataclass(frozen=True)
class ShardLayout:
    """What rank `rank` of `size` owns, as [start, end) ranges in units of heads, columns or vocab rows."""

    rank: int
    size: int
    heads: Range  # attention (query) heads
    kv_heads: Range
    intermediate: Range  # MLP columns
    vocab: Range
    vocab_sizes: tuple[int, ...]  # every rank's vocab share, for gathering logits
    # each expert's MLP columns (mixture-of-experts models: every rank holds a slice of every expert, so the
    # experts need no routing across ranks, only the all-reduce a dense MLP has); (0, 0) for dense models
    expert_intermediate: Range = (0, 0)

    @property
    def num_heads(self) -> int:
        return self.heads[1] - self.heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def intermediate_size(self) -> int:
        return self.intermediate[1] - self.intermediate[0]

    @property
    def expert_intermediate_size(self) -> int:
        return self.expert_intermediate[1] - self.expert_intermediate[0]

    @property
    def vocab_size(self) -> int:
        return self.vocab[1] - self.vocab[0]

    def span(self, unit: str, head_dim: int) -> Range:
        """The range of tensor rows/columns this rank holds for a dimension measured in `unit`."""
        if unit == "heads":
            return self.heads[0] * head_dim, self.heads[1] * head_dim
        if unit == "kv_heads":
            return self.kv_heads[0] * head_dim, self.kv_heads[1] * head_dim
        if unit == "intermediate":
            return self.intermediate
        if unit == "expert_intermediate":
            return self.expert_intermediate
        if unit == "vocab":
            return self.vocab
        raise ValueError(f"unknown shard unit {unit!r}")


def check_tp_size(cfg: ModelConfig, size: int) -> None:
    """Raise ValueError when the model cannot be split `size` ways (every rank needs at least one head)."""
    if size < 1:
        raise ValueError(f"tp_size must be >= 1, got {size}")
    if size > cfg.num_attention_heads:
        raise ValueError(f"tp_size={size} exceeds the model's {cfg.num_attention_heads} attention heads")


def shard_layout(cfg: ModelConfig, rank: int, size: int) -> ShardLayout:
    """Rank `rank`'s share of the model. size=1 is the whole model."""
    check_tp_size(cfg, size)
    assert 0 <= rank < size, (rank, size)
    H, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    group = H // Hkv
    if size <= Hkv:  # whole KV groups per rank
        kv = even_split(Hkv, size, rank)
        heads = (kv[0] * group, kv[1] * group)
    else:  # more ranks than KV heads: ranks sharing a KV head replicate it and split its query heads
        kv_head = rank * Hkv // size
        sharers = [r for r in range(size) if r * Hkv // size == kv_head]
        lo, hi = even_split(group, len(sharers), sharers.index(rank))
        kv = (kv_head, kv_head + 1)
        heads = (kv_head * group + lo, kv_head * group + hi)
    return ShardLayout(
        rank=rank, size=size, heads=heads, kv_heads=kv,
        intermediate=even_split(cfg.intermediate_size, size, rank),
        vocab=even_split(cfg.vocab_size, size, rank),
        vocab_sizes=tuple(b - a for a, b in (even_split(cfg.vocab_size, size, r) for r in range(size))),
        expert_intermediate=(0, 0) if cfg.moe is None else even_split(cfg.moe.intermediate_size, size, rank),
    )


class TPGroup:
    """This process's place in a tensor-parallel group: its layout and the collectives over `process_group`.

    Collectives must be entered by every rank in the same order (the workers run the same forward in
    lockstep). With size 1 there is no process group and every collective returns its input.
    """

    def __init__(self, layout: ShardLayout, process_group: Any = None) -> None:
        assert layout.size == 1 or process_group is not None, "a sharded model needs a process group"
        self.layout = layout
        self.rank = layout.rank
        self.size = layout.size
        self.process_group = process_group

    @classmethod
    def single(cls, cfg: ModelConfig) -> TPGroup:
        return cls(shard_layout(cfg, 0, 1))

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's partial `x` (in place), e.g. after a row-parallel linear."""
        if self.size == 1:
            return x
        torch.distributed.all_reduce(x, group=self.process_group)
        return x

    def gather_vocab(self, local: torch.Tensor) -> torch.Tensor | None:
        """(N, own vocab) on every rank -> (N, vocab) on rank 0, None elsewhere."""
        if self.size == 1:
            return local
        width = max(self.layout.vocab_sizes)
        if local.shape[1] < width:  # uneven split: gather equal shapes, trim on rank 0
            local = torch.nn.functional.pad(local, (0, width - local.shape[1]))
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.size)] if self.rank == 0 else None
        torch.distributed.gather(local, parts, dst=0, group=self.process_group)
        if parts is None:
            return None
        return torch.cat([p[:, :n] for p, n in zip(parts, self.layout.vocab_sizes)], dim=1)  # (N, vocab)
