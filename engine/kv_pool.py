"""The KV pool: a request-to-token table, a free list of token slots, and the K/V storage of those slots.

Two levels, as in SGLang: `ReqToTokenPool` maps (request slot, position) -> KV slot; `KVPool` hands out slots
from a free list. `KVCache` is the storage: per-layer K and V for every slot. The in-process runner keeps the
storage beside the allocator (`KVPool.cache`); with tensor parallelism the allocator stays with the scheduler
and each worker holds a `KVCache` for its own KV heads, indexed by the same slot ids. Slot 0 is never handed
out (a padding target). None of these is thread-safe: only the scheduler thread (or one worker) touches them.
"""

from __future__ import annotations

import torch

from sgnb.kernels.kv_store import store_kv
from sgnb.kernels.rope import apply_rope_and_store


class ReqToTokenPool:
    """A table of `size` rows x `max_context` KV slot indices, one row per live request.

    Write it through `write` / `write_points` only: with `track_writes` (tensor parallelism) they record which
    entries changed, and `take_writes` hands those to the workers, whose copies of the table must stay equal.
    """

    def __init__(self, size: int, max_context: int, device: torch.device, track_writes: bool = False) -> None:
        self.size = size
        self.max_context = max_context
        self.req_to_token = torch.zeros(size, max_context, dtype=torch.int64, device=device)
        self._free = list(range(size - 1, -1, -1))
        self._dirty: dict[int, tuple[int, int]] | None = {} if track_writes else None  # row -> [lo, hi)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """req_to_token[row, start: start + len(slots)] = slots."""
        end = start + len(slots)
        if self._dirty is not None:
            if torch.equal(self.req_to_token[row, start:end], slots.to(self.req_to_token.device)):
                return  # e.g. re-pointing a prefix at the tree's slots that it already uses
            self._mark(row, start, end)
        self.req_to_token[row, start:end] = slots

    def write_points(self, rows: torch.Tensor, cols: torch.Tensor, slots: torch.Tensor) -> None:
        """req_to_token[rows[i], cols[i]] = slots[i] (one new token per request: a decode step)."""
        if self._dirty is not None:
            for r, c in zip(rows.tolist(), cols.tolist()):
                self._mark(r, c, c + 1)
        self.req_to_token[rows, cols] = slots

    def _mark(self, row: int, start: int, end: int) -> None:
        assert self._dirty is not None
        lo, hi = self._dirty.get(row, (start, end))
        self._dirty[row] = (min(lo, start), max(hi, end))

    def take_writes(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(rows, cols, slots): the current value of every entry written since the last call, flat, so that
        `copy[rows, cols] = slots` brings a copy of the table up to date (tracked pools only)."""
        assert self._dirty is not None, "this pool does not track writes"
        spans = self._dirty
        self._dirty = {}
        row_ids = torch.tensor(list(spans), dtype=torch.int64)
        lo, hi = torch.tensor(list(spans.values()), dtype=torch.int64).view(-1, 2).unbind(1)  # (n,), (n,)
        lens = hi - lo
        rows = row_ids.repeat_interleave(lens)  # (total,)
        starts = torch.cumsum(lens, 0) - lens  # where each span begins in the flat output
        cols = torch.arange(int(lens.sum())) - starts.repeat_interleave(lens) + lo.repeat_interleave(lens)
        rows, cols = rows.to(self.req_to_token.device), cols.to(self.req_to_token.device)
        return rows, cols, self.req_to_token[rows, cols]

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, index: int) -> None:
        assert index not in self._free, f"req slot {index} freed twice"
        self._free.append(index)

    @property
    def available(self) -> int:
        return len(self._free)


class KVCache:
    """Per-layer K/V buffers of shape (num_slots + 2, num_kv_heads, head_dim): the storage of every slot.

    Slot 0 stays zero (it pads gathers); slot num_slots + 1 (`scratch_slot`) is never handed out either: the
    padding rows of a CUDA-graph batch write their K/V there."""

    def __init__(
        self, num_slots: int, num_layers: int, num_kv_heads: int, head_dim: int,
        dtype: torch.dtype, device: torch.device,
    ) -> None:
        self.scratch_slot = num_slots + 1
        shape = (num_slots + 2, num_kv_heads, head_dim)
        # empty, not zeros: a large pool is never touched before use, so it costs no start-up time
        self.k_buffers = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffers = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        for buf in (*self.k_buffers, *self.v_buffers):
            buf[0].zero_()  # slot 0 pads gathers (masked keys): garbage there could be NaN, and 0 * NaN = NaN

    def store(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the new tokens' K and V (T, Hkv, D), possibly strided views, at slots `loc` (T,) of `layer`."""
        store_kv(self.k_buffers[layer], self.v_buffers[layer], loc, k, v)

    def store_rope(self, layer: int, loc: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotate q and k in place (RoPE at `positions`), then store k and v as `store` does: one launch on
        CUDA (a decode step's ~32 layers each save one kernel)."""
        apply_rope_and_store(q, k, v, positions, cos, sin, self.k_buffers[layer], self.v_buffers[layer], loc)

    def bytes_per_token(self) -> int:
        k = self.k_buffers[0]
        return 2 * len(self.k_buffers) * k.shape[1] * k.shape[2] * k.element_size()


PENDING_MERGE = 256  # freed slot lists kept before they are merged into the free list


class KVPool:
    """A free list of slots 1..num_slots on `device`, and the slots' storage when it lives in this process
    (`cache`; None when tensor-parallel workers hold it)."""

    def __init__(self, num_slots: int, device: torch.device, cache: KVCache | None = None) -> None:
        self.size = num_slots
        self.device = device
        self.cache = cache
        self._free = torch.arange(1, num_slots + 1, dtype=torch.int64, device=device)
        self._num_free = num_slots  # len(_free) + the pending slots, kept as a count: `available` is hot
        self._pending: list[torch.Tensor] = []  # freed slots, merged lazily (cat is cheaper once per step)

    @property
    def available(self) -> int:
        return self._num_free

    def _merge(self) -> None:
        self._free = torch.cat([self._free, *self._pending])
        self._pending = []

    def alloc(self, n: int) -> torch.Tensor | None:
        """n slots (int64 tensor), or None when fewer than n are free (the caller evicts and retries)."""
        if n > len(self._free) and self._pending:
            self._merge()
        if n > len(self._free):
            return None
        out, self._free = self._free[:n], self._free[n:]
        self._num_free -= n
        return out

    def free(self, slots: torch.Tensor) -> None:
        n = slots.numel()
        if n:
            self._pending.append(slots.to(torch.int64))
            self._num_free += n
            if len(self._pending) >= PENDING_MERGE:  # many small frees (jump-forward rollbacks): bound the list
                self._merge()

    def clear(self) -> None:
        self._free = torch.arange(1, self.size + 1, dtype=torch.int64, device=self.device)
        self._num_free = self.size
        self._pending = []
