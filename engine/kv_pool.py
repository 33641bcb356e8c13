"""The KV pool: a request-to-token table, a free list of token slots, and the K/V storage of those slots.

Two levels, as in SGLang: `ReqToTokenPool` maps (request slot, position) -> KV slot; `KVPool` hands out slots
from a free list. `KVCache` is the storage: per-layer K and V for every slot. The in-process runner keeps the
storage beside the allocator (`KVPool.cache`); with tensor parallelism the allocator stays with the scheduler
and each worker holds a `KVCache` for its own KV heads, indexed by the same slot ids. Slot 0 is never handed
out (a padding target). None of these is thread-safe: only the scheduler thread (or one worker) touches them.

Slot ids live on the host, as numpy int64 arrays: the free list, the tree's node values and the request table
are bookkeeping that the scheduler thread reads and writes a few times per request and per step, and a numpy op
on a few hundred ids costs about a microsecond and keeps the interpreter lock, where the same op on a torch tensor
costs 5-15 us of dispatch (plus a launch on CUDA) and hands the lock to the program threads
(benchmarks/results/NOTES.md, 2026-12-07 session 23). The device sees slot ids only in a forward's batch
(`ForwardBatch.build`) and in the device copy of the request table, which is brought up to date once per forward.
"""

from __future__ import annotations

import numpy as np
import torch

from sgnb.kernels.kv_store import store_kv
from sgnb.kernels.rope import apply_rope_and_store

_NO_WRITES = np.empty(0, dtype=np.int64)
_NO_WRITES.flags.writeable = False


class ReqToTokenPool:
    """A table of `size` rows x `max_context` KV slot indices, one row per live request.

    `table` (numpy, on the host) is the truth, and what the scheduler reads. `req_to_token` is the torch tensor
    the forward reads: on a CPU device the same memory; elsewhere a device copy that `sync_device` brings up to
    date (one transfer and one scatter per forward). Write through `write` / `write_points` only: they record
    which entries changed when a copy must follow, and `take_writes` hands those over (tensor-parallel workers
    hold copies too: `track_writes`).
    """

    def __init__(self, size: int, max_context: int, device: torch.device, track_writes: bool = False) -> None:
        self.size = size
        self.max_context = max_context
        self.table = np.zeros((size, max_context), dtype=np.int64)
        shared = device.type == "cpu"
        self.req_to_token = (torch.from_numpy(self.table) if shared
                             else torch.zeros(size, max_context, dtype=torch.int64, device=device))
        self._free = list(range(size - 1, -1, -1))
        self._device_copy = not shared
        # row -> [lo, hi) written since the last take_writes; None when nothing follows the table
        self._dirty: dict[int, tuple[int, int]] | None = {} if (track_writes or not shared) else None

    def write(self, row: int, start: int, slots: np.ndarray) -> None:
        """table[row, start: start + len(slots)] = slots."""
        end = start + len(slots)
        if self._dirty is not None:
            if np.array_equal(self.table[row, start:end], slots):
                return  # e.g. re-pointing a prefix at the tree's slots that it already uses
            self._mark(row, start, end)
        self.table[row, start:end] = slots

    def write_points(self, rows: list[int], cols: list[int], slots: np.ndarray) -> None:
        """table[rows[i], cols[i]] = slots[i] (one new token per request: a decode step)."""
        if self._dirty is not None:
            for r, c in zip(rows, cols):
                self._mark(r, c, c + 1)
        self.table[rows, cols] = slots

    def _mark(self, row: int, start: int, end: int) -> None:
        assert self._dirty is not None
        lo, hi = self._dirty.get(row, (start, end))
        self._dirty[row] = (min(lo, start), max(hi, end))

    def take_writes(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(rows, cols, slots): the current value of every entry written since the last call, flat int64
        arrays, so that `copy[rows, cols] = slots` brings a copy of the table up to date (tracked pools only)."""
        assert self._dirty is not None, "this pool does not track writes"
        spans, self._dirty = self._dirty, {}
        if not spans:
            return _NO_WRITES, _NO_WRITES, _NO_WRITES
        row_ids = np.fromiter(spans, dtype=np.int64, count=len(spans))
        lo, hi = np.array(list(spans.values()), dtype=np.int64).reshape(-1, 2).T  # (n,), (n,)
        lens = hi - lo
        rows = np.repeat(row_ids, lens)  # (total,)
        starts = np.cumsum(lens) - lens  # where each span begins in the flat output
        cols = np.arange(int(lens.sum()), dtype=np.int64) + np.repeat(lo - starts, lens)
        return rows, cols, self.table[rows, cols]

    def sync_device(self) -> None:
        """Bring the device copy up to date (no-op when it is the table itself): one non-blocking copy through
        pinned memory and one scatter, ordered on the current stream before the forward that reads it."""
        if not self._device_copy or not self._dirty:
            return
        rows, cols, vals = self.take_writes()
        host = torch.from_numpy(np.stack([rows, cols, vals])).pin_memory()
        dev = host.to(self.req_to_token.device, non_blocking=True)
        self.req_to_token[dev[0], dev[1]] = dev[2]

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
    """A free list of slots 1..num_slots (host int64 ids), and the slots' storage when it lives in this process
    (`cache`; None when tensor-parallel workers hold it)."""

    def __init__(self, num_slots: int, cache: KVCache | None = None) -> None:
        self.size = num_slots
        self.cache = cache
        self._free: np.ndarray  # read-only: handed-out slices are views, nobody writes through them
        self._num_free: int  # len(_free) + the pending slots, kept as a count: `available` is hot
        self._pending: list[np.ndarray]  # freed slots, merged lazily (one concatenation per many frees)
        self.clear()

    @property
    def available(self) -> int:
        return self._num_free

    def _merge(self) -> None:
        self._free = np.concatenate([self._free, *self._pending])
        self._free.flags.writeable = False
        self._pending = []

    def alloc(self, n: int) -> np.ndarray | None:
        """n slots (a read-only int64 view), or None when fewer than n are free (the caller evicts and retries)."""
        if n > len(self._free) and self._pending:
            self._merge()
        if n > len(self._free):
            return None
        out, self._free = self._free[:n], self._free[n:]
        self._num_free -= n
        return out

    def free(self, slots: np.ndarray) -> None:
        """Take back `slots`, which the caller no longer reads or writes (a copy, never a view of the table)."""
        n = len(slots)
        if n:
            self._pending.append(np.asarray(slots, dtype=np.int64))
            self._num_free += n
            if len(self._pending) >= PENDING_MERGE:  # many small frees (jump-forward rollbacks): bound the list
                self._merge()

    def clear(self) -> None:
        self._free = np.arange(1, self.size + 1, dtype=np.int64)
        self._free.flags.writeable = False
        self._num_free = self.size
        self._pending = []
