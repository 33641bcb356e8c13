"""The KV pool: a request-to-token table and a token-slot pool holding every layer's K and V.

Two levels, as in SGLang: `ReqToTokenPool` maps (request slot, position) -> KV slot; `KVPool` owns the
per-layer K/V buffers and a free list of slots. Slot 0 is never handed out (a padding target).
Neither is thread-safe: only the scheduler thread touches them.
"""

from __future__ import annotations

import torch


class ReqToTokenPool:
    """A table of `size` rows x `max_context` KV slot indices, one row per live request."""

    def __init__(self, size: int, max_context: int, device: torch.device) -> None:
        self.size = size
        self.max_context = max_context
        self.req_to_token = torch.zeros(size, max_context, dtype=torch.int64, device=device)
        self._free = list(range(size - 1, -1, -1))

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, index: int) -> None:
        assert index not in self._free, f"req slot {index} freed twice"
        self._free.append(index)

    @property
    def available(self) -> int:
        return len(self._free)


class KVPool:
    """Per-layer K/V buffers of shape (num_slots + 1, num_kv_heads, head_dim) and a free list of slots."""

    def __init__(
        self, num_slots: int, num_layers: int, num_kv_heads: int, head_dim: int,
        dtype: torch.dtype, device: torch.device,
    ) -> None:
        self.size = num_slots
        self.dtype = dtype
        self.device = device
        shape = (num_slots + 1, num_kv_heads, head_dim)
        # empty, not zeros: a large pool is never touched before use, so it costs no start-up time
        self.k_buffers = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffers = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        for buf in (*self.k_buffers, *self.v_buffers):
            buf[0].zero_()  # slot 0 pads gathers (masked keys): garbage there could be NaN, and 0 * NaN = NaN
        self._free = torch.arange(1, num_slots + 1, dtype=torch.int64, device=device)
        self._pending: list[torch.Tensor] = []  # freed slots, merged lazily (cat is cheaper once per step)

    @property
    def available(self) -> int:
        return len(self._free) + sum(len(p) for p in self._pending)

    def alloc(self, n: int) -> torch.Tensor | None:
        """n slots (int64 tensor), or None when fewer than n are free (the caller evicts and retries)."""
        if n > len(self._free) and self._pending:
            self._free = torch.cat([self._free, *self._pending])
            self._pending = []
        if n > len(self._free):
            return None
        out, self._free = self._free[:n], self._free[n:]
        return out

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel():
            self._pending.append(slots.to(torch.int64))

    def bytes_per_token(self) -> int:
        k = self.k_buffers[0]
        return 2 * len(self.k_buffers) * k.shape[1] * k.shape[2] * k.element_size()

    def clear(self) -> None:
        self._free = torch.arange(1, self.size + 1, dtype=torch.int64, device=self.device)
        self._pending = []
