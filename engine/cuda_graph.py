"""CUDA graphs for decode: the model's decode forward captured once per batch size, then replayed.

Outside a graph a 7B decode step launches ~1,850 kernels at ~12 us of host time each, so the GPU idles most of
a small batch's step. At engine start `DecodeGraphs` captures the forward (embedding, every layer, final norm;
not the LM head) for a ladder of batch sizes (1, 2, 4, 8, 16, 24, 32, ... up to max_bs), every graph in one
memory pool, largest first. Each size owns a static ForwardBatch: one int64 device buffer holding input ids,
positions, request rows and sequence lengths (filled by one host-to-device copy per step) and the new tokens'
KV slots. A batch of b requests replays the smallest captured size bs >= b; the bs - b padding rows read
request row `pad_row` (never handed out, all zeros: one key, the zero slot 0) and write their K/V to the
cache's scratch slot, so they touch nothing a request owns, and their outputs are dropped.

What a graph cannot see: the batch's shared prefix (cascade) and groups. A replay reads every request's whole
key range, which computes the same attention; cascade stays on the eager path (prefill, bigger batches).
The attention backend provides the capture/replay hooks (engine/attention/base.py); the torch reference has
none, so the graphs need the triton or flashinfer backend.

`capture=False` (tests on the CPU) keeps the static buffers and padding but runs the forward eagerly on them.
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import Any

import numpy as np
import torch

from sgnb.engine.forward_batch import BatchSpec, ForwardBatch, ForwardMode

log = logging.getLogger("sgnb.engine")

DEFAULT_MAX_BS = 256


def graph_batch_sizes(max_bs: int) -> list[int]:
    """The captured sizes: 1, 2, 4, 8, then every multiple of 8 up to max_bs (and max_bs itself)."""
    sizes = [s for s in (1, 2, 4) if s < max_bs] + list(range(8, max_bs + 1, 8))
    if not sizes or sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sorted(set(sizes))


class _Static:
    """One batch size's inputs: a (5, bs) int64 buffer (ids, positions, rows, seq lens, the new tokens' KV slots)
    and the ForwardBatch built over it (prefix_lens is positions: in decode they are equal)."""

    def __init__(self, bs: int, req_to_token: torch.Tensor, pad_row: int, scratch_slot: int,
                 device: torch.device, pin: bool) -> None:
        self.bs = bs
        self.host = torch.zeros(5, bs, dtype=torch.int64, pin_memory=pin)
        self.host_np = self.host.numpy()
        self.host_np[2] = pad_row
        self.host_np[3] = 1
        self.host_np[4] = scratch_slot
        self.buf = self.host.to(device)
        self.copied = torch.cuda.Event() if pin else None  # the last host-to-device copy out of `host`
        ids, pos, rows, seq, loc = self.buf.unbind(0)
        self.loc = loc  # the new tokens' KV slots on the device (padding rows: the scratch slot)
        self.fb = ForwardBatch(
            mode=ForwardMode.DECODE, batch_size=bs, num_tokens=bs, input_ids=ids, positions=pos,
            out_cache_loc=loc, req_pool_indices=rows, prefix_lens=pos, seq_lens=seq,
            qo_indptr=torch.arange(bs + 1, dtype=torch.int64, device=device),
            req_pool_indices_cpu=[pad_row] * bs, prefix_lens_cpu=[0] * bs, extend_lens_cpu=[1] * bs,
            seq_lens_cpu=[1] * bs, req_to_token=req_to_token)


class DecodeGraphs:
    """Captured decode forwards of `model` over `attn` for batch sizes up to max_bs (see the module docstring)."""

    def __init__(self, model: Any, attn: Any, req_to_token: torch.Tensor, pad_row: int, scratch_slot: int,
                 max_bs: int, max_kv_tokens: int, device: torch.device, capture: bool = True) -> None:
        assert attn.supports_cuda_graph, f"the {attn.name} attention backend cannot run inside a CUDA graph"
        self.model, self.attn, self.device, self.captured = model, attn, device, capture
        self.pad_row, self.scratch_slot = pad_row, scratch_slot
        self.sizes = graph_batch_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        pin = device.type == "cuda"
        self.static = {bs: _Static(bs, req_to_token, pad_row, scratch_slot, device, pin) for bs in self.sizes}
        for st in self.static.values():
            st.fb.attn_backend = attn
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.replays = 0
        attn.init_cuda_graph_state(self.max_bs, max_kv_tokens)
        t0 = time.perf_counter()
        if capture:
            self._capture_all()
        self.capture_seconds = time.perf_counter() - t0
        if capture:
            log.info("captured %d decode CUDA graphs (batch 1..%d) in %.1f s", len(self.sizes), self.max_bs,
                     self.capture_seconds)

    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        for bs in reversed(self.sizes):  # largest first: the smaller graphs reuse its pool memory
            st = self.static[bs]
            self.attn.init_capture_metadata(st.fb)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # warm up: compile kernels, settle allocator
                for _ in range(2):
                    self.model(st.fb)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=side):
                self.outputs[bs] = self.model(st.fb)
            self.graphs[bs] = graph
        torch.cuda.synchronize(self.device)

    def can_run(self, spec: BatchSpec) -> bool:
        return spec.mode is ForwardMode.DECODE and self.fits(spec.batch_size) and not spec.mm_rows

    def fits(self, batch_size: int) -> bool:
        """Whether a decode batch of this many text requests replays a graph."""
        return batch_size <= self.max_bs

    def replay(self, spec: BatchSpec) -> torch.Tensor:
        """Hidden states (b, hidden) of a decode batch of b <= max_bs requests: a view into the graph's output,
        valid until the next replay."""
        b = spec.batch_size
        bs = self.sizes[bisect.bisect_left(self.sizes, b)]
        st = self.static[bs]
        if st.copied is not None:
            st.copied.synchronize()  # the previous step's copy out of this host buffer is done (it always is)
        h = st.host_np
        prefix = np.asarray(spec.prefix_lens, dtype=np.int64)
        h[0, :b] = spec.input_ids
        h[1, :b] = prefix
        h[2, :b] = spec.req_pool_indices
        h[3, :b] = prefix + 1
        h[4, :b] = spec.out_cache_loc
        h[:, b:] = ((0,), (0,), (self.pad_row,), (1,), (self.scratch_slot,))
        st.buf.copy_(st.host, non_blocking=True)
        if st.copied is not None:
            st.copied.record()
        if spec.input_ids_device is not None:  # overlap scheduling: the previous step's tokens, on the device
            st.buf[0, :b].copy_(spec.input_ids_device)
        fb = st.fb
        fb.req_pool_indices_cpu = h[2].tolist()
        fb.prefix_lens_cpu = h[1].tolist()
        fb.seq_lens_cpu = h[3].tolist()
        self.attn.init_replay_metadata(fb)
        self.replays += 1
        if not self.captured:
            return self.model(fb)[:b]
        self.graphs[bs].replay()
        return self.outputs[bs][:b]

    def describe(self) -> dict:
        return {"batch_sizes": self.sizes, "capture_seconds": round(self.capture_seconds, 3),
                "replays": self.replays, "captured": self.captured}


def extend_token_sizes(max_tokens: int) -> list[int]:
    """The token budgets of the extend graphs: powers of two from 16 up to max_tokens (and max_tokens)."""
    if max_tokens <= 0:
        return []
    sizes = [n for n in (16, 32, 64, 128, 256, 512, 1024, 2048) if n < max_tokens] + [max_tokens]
    return sorted(set(sizes))


class _StaticExtend:
    """One token budget's inputs: a flat int64 buffer (ids, positions | rows, prefix lens, seq lens | indptr |
    block table | the new tokens' KV slots) filled by one host-to-device copy, and the ForwardBatch over it."""

    def __init__(self, tokens: int, max_reqs: int, head_dim: int, req_to_token: torch.Tensor, pad_row: int,
                 scratch_slot: int, device: torch.device, pin: bool) -> None:
        from sgnb.kernels.extend_attention import extend_block_m

        self.tokens, self.max_reqs = tokens, max_reqs
        self.block_m = extend_block_m(head_dim, tokens)
        self.num_blocks = -(-tokens // self.block_m) + max_reqs  # sum of ceil(e_i / BM) <= T / BM + B
        T, B = tokens, max_reqs
        self.split = [T, T, B, B, B, B + 1, 2 * self.num_blocks, T]
        self.host = torch.zeros(sum(self.split), dtype=torch.int64, pin_memory=pin)
        self.host_np = self.host.numpy()
        self.buf = self.host.to(device)
        self.copied = torch.cuda.Event() if pin else None
        ids, pos, rows, pre, seq, ptr, blocks, loc = self.buf.split(self.split)
        self.loc = loc  # the new tokens' KV slots on the device (padding rows: the scratch slot)
        self.views = [a for a in np.split(self.host_np, np.cumsum(self.split)[:-1])]
        self.pad_row, self.scratch_slot = pad_row, scratch_slot
        self.clear()
        self.buf.copy_(self.host)
        self.fb = ForwardBatch(
            mode=ForwardMode.EXTEND, batch_size=B, num_tokens=T, input_ids=ids, positions=pos, out_cache_loc=loc,
            req_pool_indices=rows, prefix_lens=pre, seq_lens=seq, qo_indptr=ptr,
            req_pool_indices_cpu=[pad_row] * B, prefix_lens_cpu=[0] * B, extend_lens_cpu=[T] + [0] * (B - 1),
            seq_lens_cpu=[0] * B, req_to_token=req_to_token, blocks=blocks.view(self.num_blocks, 2))

    def clear(self) -> None:
        """No request: every block idle (what the graph is captured over)."""
        ids, pos, rows, pre, seq, ptr, blocks, loc = self.views
        ids[:], pos[:], rows[:], pre[:], seq[:], ptr[:], loc[:] = 0, 0, self.pad_row, 0, 0, 0, self.scratch_slot
        blocks.reshape(-1, 2)[:] = (-1, 0)

    def fill(self, spec: BatchSpec) -> None:
        from sgnb.kernels.extend_attention import extend_blocks

        T, B = spec.num_tokens, spec.batch_size
        ids, pos, rows, pre, seq, ptr, blocks, loc = self.views
        prefix = np.asarray(spec.prefix_lens, dtype=np.int64)  # (B,)
        extend = np.asarray(spec.extend_lens, dtype=np.int64)  # (B,)
        ids[:T] = spec.input_ids
        ids[T:] = 0
        ptr[0] = 0
        np.cumsum(extend, out=ptr[1:B + 1])
        ptr[B + 1:] = T  # requests past the batch own no rows
        pos[:T] = np.arange(T, dtype=np.int64) + np.repeat(prefix - ptr[:B], extend)  # (T,)
        pos[T:] = 0
        rows[:B], rows[B:] = spec.req_pool_indices, self.pad_row
        pre[:B], pre[B:] = prefix, 0
        seq[:B], seq[B:] = prefix + extend, 0
        blocks.reshape(-1, 2)[:] = extend_blocks(extend, self.block_m, self.num_blocks)
        loc[:T], loc[T:] = spec.out_cache_loc, self.scratch_slot


class ExtendGraphs:
    """Captured extend forwards (prefill chunks, mixed batches, jump-forward extends) for token budgets 16, 32,
    ..., max_tokens. Outside a graph a forward's host cost (tens of microseconds per kernel launch, ~10 launches a
    layer) exceeds what a small extend needs of the GPU, so a program's many small prefills (a new turn, a
    select's choices, a fork's branches) would run at the host's rate.

    A batch of T tokens from B requests replays the smallest budget >= T. Its attention runs over a fixed grid
    through a block table (kernels/extend_attention.extend_blocks), so the captured launch serves any split of
    the budget into requests; padding tokens write the scratch KV slot and their rows are dropped. No cascade in
    a graph (the batch's shared prefix is read per request, which computes the same attention)."""

    def __init__(self, model: Any, attn: Any, req_to_token: torch.Tensor, pad_row: int, scratch_slot: int,
                 max_tokens: int, max_reqs: int, head_dim: int, device: torch.device, capture: bool = True) -> None:
        assert attn.supports_extend_graph, f"the {attn.name} attention backend cannot run extends in a CUDA graph"
        self.model, self.attn, self.device, self.captured = model, attn, device, capture
        self.scratch_slot = scratch_slot
        self.sizes = extend_token_sizes(max_tokens)
        self.max_tokens = self.sizes[-1]
        pin = device.type == "cuda"
        self.static = {n: _StaticExtend(n, min(n, max_reqs), head_dim, req_to_token, pad_row, scratch_slot, device,
                                        pin) for n in self.sizes}
        for st in self.static.values():
            st.fb.attn_backend = attn
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.replays = 0
        t0 = time.perf_counter()
        if capture:
            self._capture_all()
        self.capture_seconds = time.perf_counter() - t0
        if capture:
            log.info("captured %d extend CUDA graphs (16..%d tokens) in %.1f s", len(self.sizes), self.max_tokens,
                     self.capture_seconds)

    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        for n in reversed(self.sizes):
            st = self.static[n]
            self.attn.init_forward_metadata(st.fb)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    self.model(st.fb)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=side):
                self.outputs[n] = self.model(st.fb)
            self.graphs[n] = graph
        torch.cuda.synchronize(self.device)

    def _size(self, spec: BatchSpec) -> int | None:
        T, B = spec.num_tokens, spec.batch_size
        if spec.mode is not ForwardMode.EXTEND or T > self.max_tokens or spec.mm_rows:
            return None
        for n in self.sizes:
            if n >= T and self.static[n].max_reqs >= B:
                return n
        return None

    def can_run(self, spec: BatchSpec) -> bool:
        return self._size(spec) is not None

    def replay(self, spec: BatchSpec) -> torch.Tensor:
        """Hidden states (T, hidden) of an extend batch of T <= max_tokens tokens: a view into the graph's output,
        valid until the next replay."""
        n = self._size(spec)
        assert n is not None, "can_run(spec) first"
        st = self.static[n]
        T = spec.num_tokens
        if st.copied is not None:
            st.copied.synchronize()
        st.fill(spec)
        st.buf.copy_(st.host, non_blocking=True)
        if st.copied is not None:
            st.copied.record()
        self.replays += 1
        if not self.captured:
            return self.model(st.fb)[:T]
        self.graphs[n].replay()
        return self.outputs[n][:T]

    def describe(self) -> dict:
        return {"token_sizes": self.sizes, "capture_seconds": round(self.capture_seconds, 3),
                "replays": self.replays, "captured": self.captured}
