"""What one model forward over a ragged batch of requests needs to know, in two forms.

- `BatchSpec`: what the scheduler decided (host lists, plus the new tokens' KV slots). It is also the wire
  format for tensor-parallel workers (`to_wire` / `from_wire`): one definition of a batch for every runner.
- `ForwardBatch`: the same batch as device tensors, built once per forward by `ForwardBatch.build` (one
  host-to-device copy for every index tensor), with host copies of the per-request lengths so that nothing on
  the forward path needs to read the device. The runner's attention backend adds its own per-forward metadata
  (`attn_metadata`) in `init_forward_metadata`, once per forward, never per layer.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from sgnb.engine.attention.base import AttentionBackend


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a device tensor without waiting for the device: on CUDA through pinned memory and
    a non-blocking copy (a plain torch.tensor(..., device="cuda") synchronizes the stream, which would wait for
    a forward in flight)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype).pin_memory().to(device, non_blocking=True)


class HostCopy:
    """Device tensors' copy to the host, started at once: into pinned buffers without blocking on CUDA (plain
    copies on the CPU). `lists()` waits for this copy only, not for whatever the device runs after it (the next
    forward, under overlap scheduling), and gives each tensor's values as lists (None for a None given)."""

    def __init__(self, *tensors: torch.Tensor | None) -> None:
        cuda = any(t is not None and t.is_cuda for t in tensors)
        self._host = [None if t is None else torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda) for t in tensors]
        for h, t in zip(self._host, tensors):
            if h is not None and t is not None:
                h.copy_(t, non_blocking=cuda)
        self._event = torch.cuda.Event() if cuda else None
        if self._event is not None:
            self._event.record()

    def lists(self) -> list[Any]:
        if self._event is not None:
            self._event.synchronize()
        return [None if h is None else h.tolist() for h in self._host]


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill: some requests add several tokens (over a cached prefix or none)
    DECODE = "decode"  # every request adds exactly one token


@dataclass
class BatchSpec:
    """One batch as the scheduler built it.

    Request i adds extend_lens[i] tokens at absolute positions prefix_lens[i] ...; the K/V of its first
    prefix_lens[i] tokens is already in the pool at req_to_token[req_pool_indices[i]]. The new tokens' K/V go
    to out_cache_loc (which the scheduler has also written into req_to_token). shared_len > 0: the first
    shared_len slots of every request are the same (a radix prefix shared by the whole batch; cascade).
    """

    input_ids: list[int]  # (T,) the new tokens of every request, concatenated
    out_cache_loc: np.ndarray  # (T,) int64 KV slots of the new tokens (host)
    req_pool_indices: list[int]  # (B,)
    prefix_lens: list[int]  # (B,)
    extend_lens: list[int]  # (B,)
    shared_len: int = 0
    # requests that share a radix prefix, contiguous in the batch: (first request, count, shared slots); every
    # request in one group (shared 0 for a lone one). None: no grouping (shared_len alone says what is shared)
    groups: list[tuple[int, int, int]] | None = None
    # multimodal: rows of the flat batch whose input embedding is replaced by encoder features (image or video
    # tokens; their input_ids are placeholders), and those features, (K, hidden) in the model's dtype
    mm_rows: list[int] | None = None  # (K,)
    mm_embeds: torch.Tensor | None = None  # (K, hidden), on the runner's device
    # decode under overlap scheduling: the input ids as a device tensor (the previous step's sampled tokens,
    # never copied to the host first); input_ids then holds placeholders of the same length
    input_ids_device: torch.Tensor | None = None
    graphed: bool = False  # set by the runner: the forward replayed a CUDA graph (no cascade then)

    @property
    def batch_size(self) -> int:
        return len(self.req_pool_indices)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def mode(self) -> ForwardMode:
        return ForwardMode.DECODE if self.num_tokens == self.batch_size else ForwardMode.EXTEND

    def last_rows(self) -> list[int]:
        """Row of each request's last new token in the flat batch (what sampling reads)."""
        return (np.cumsum(self.extend_lens) - 1).tolist()

    def to_wire(self) -> dict[str, Any]:
        """Picklable, torch-free form (numpy arrays) for the tensor-parallel workers (text batches only)."""
        assert not self.mm_rows, "multimodal batches do not run tensor-parallel"
        assert self.input_ids_device is None, "overlap scheduling runs in-process only"
        return {"input_ids": np.asarray(self.input_ids, dtype=np.int64),
                "out_cache_loc": self.out_cache_loc,
                "req_pool_indices": self.req_pool_indices, "prefix_lens": self.prefix_lens,
                "extend_lens": self.extend_lens, "shared_len": self.shared_len, "groups": self.groups}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> BatchSpec:
        return cls(input_ids=d["input_ids"].tolist(), out_cache_loc=d["out_cache_loc"],
                   req_pool_indices=d["req_pool_indices"], prefix_lens=d["prefix_lens"],
                   extend_lens=d["extend_lens"], shared_len=d["shared_len"], groups=d.get("groups"))


# Triton specializes a kernel on each pointer argument's 16-byte alignment, so a view starting at an odd int64
# offset of the shared buffer compiles another variant of every kernel reading it. With the segments packed end
# to end, the alignment of qo_indptr and prefix_lens followed the batch size's parity and that of positions the
# token count's, so the first eager forward of a new parity could compile kernels inside a program's timing
# (benchmarks/results/NOTES.md). Every segment starts 16-byte aligned.
ALIGN_INT64 = 2  # int64 elements per 16 bytes


def _aligned_concat(parts: list[np.ndarray]) -> tuple[np.ndarray, list[int]]:
    """The int64 arrays in one buffer, each starting at a multiple of ALIGN_INT64 elements; and those starts."""
    starts, n = [], 0
    for p in parts:
        starts.append(n)
        n += -(-len(p) // ALIGN_INT64) * ALIGN_INT64
    host = np.zeros(n, dtype=np.int64)
    for s, p in zip(starts, parts):
        host[s: s + len(p)] = p
    return host, starts


@dataclass
class ForwardBatch:
    """A BatchSpec on the device. Tensors are int64 on `input_ids.device`; `*_cpu` are host copies."""

    mode: ForwardMode
    batch_size: int
    num_tokens: int
    input_ids: torch.Tensor  # (T,)
    positions: torch.Tensor  # (T,) absolute position of each new token
    out_cache_loc: torch.Tensor  # (T,) KV slots of the new tokens
    req_pool_indices: torch.Tensor  # (B,) rows of req_to_token
    prefix_lens: torch.Tensor  # (B,)
    seq_lens: torch.Tensor  # (B,) prefix + extend: keys each request attends to
    qo_indptr: torch.Tensor  # (B + 1,) request i's new tokens are rows qo_indptr[i]:qo_indptr[i + 1]
    req_pool_indices_cpu: list[int]
    prefix_lens_cpu: list[int]
    extend_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    req_to_token: torch.Tensor  # (R, max_context) the table, shared with the scheduler (not a copy)
    shared_len: int = 0
    groups: list[tuple[int, int, int]] | None = None  # see BatchSpec
    mm_rows: torch.Tensor | None = None  # (K,) rows whose embedding is mm_embeds (see BatchSpec)
    mm_embeds: torch.Tensor | None = None  # (K, hidden)
    attn_backend: AttentionBackend | None = None  # attached by the runner
    attn_metadata: Any = None  # the attention backend's per-forward state
    # an extend CUDA graph's batch (engine/cuda_graph.py): (NB, 2) query blocks for a fixed-grid extend attention
    # (kernels/extend_attention.extend_blocks); max_extend_len is then the graph's token budget
    blocks: torch.Tensor | None = None

    @property
    def max_extend_len(self) -> int:
        return max(self.extend_lens_cpu)

    @classmethod
    def build(cls, spec: BatchSpec, req_to_token: torch.Tensor, device: torch.device) -> ForwardBatch:
        """Everything in one host buffer, copied to the device once, then split into views."""
        B, T = spec.batch_size, spec.num_tokens
        prefix = np.asarray(spec.prefix_lens, dtype=np.int64)  # (B,)
        extend = np.asarray(spec.extend_lens, dtype=np.int64)  # (B,)
        seq = prefix + extend  # (B,)
        indptr = np.zeros(B + 1, dtype=np.int64)
        np.cumsum(extend, out=indptr[1:])
        if T == B:  # decode: one token per request, at position prefix
            positions = prefix
        else:  # position of token t of request i = prefix[i] + (t - indptr[i])
            positions = np.arange(T, dtype=np.int64) + np.repeat(prefix - indptr[:-1], extend)  # (T,)
        parts = [np.asarray(spec.input_ids, dtype=np.int64), positions,
                 np.asarray(spec.req_pool_indices, dtype=np.int64), prefix, seq, indptr, spec.out_cache_loc]
        host, starts = _aligned_concat(parts)
        buf = torch.from_numpy(host)
        if device.type == "cuda":
            buf = buf.pin_memory().to(device, non_blocking=True)
        ids, pos, rows, pre, sl, ptr, loc = (buf[s: s + len(p)] for s, p in zip(starts, parts))
        mm_rows = None
        if spec.mm_rows:
            mm_rows = torch.tensor(spec.mm_rows, dtype=torch.int64).to(device, non_blocking=True)
        if spec.input_ids_device is not None:
            ids.copy_(spec.input_ids_device)
        return cls(
            mode=spec.mode, batch_size=B, num_tokens=T, input_ids=ids, positions=pos,
            out_cache_loc=loc, req_pool_indices=rows, prefix_lens=pre, seq_lens=sl,
            qo_indptr=ptr, req_pool_indices_cpu=list(spec.req_pool_indices), prefix_lens_cpu=list(spec.prefix_lens),
            extend_lens_cpu=list(spec.extend_lens), seq_lens_cpu=seq.tolist(), req_to_token=req_to_token,
            shared_len=spec.shared_len, groups=spec.groups, mm_rows=mm_rows,
            mm_embeds=None if spec.mm_embeds is None else spec.mm_embeds.to(device, non_blocking=True),
        )
