"""The torch reference backend: the CPU path, and the oracle the fast backends are tested against.

A sliding-window layer (`layer.sliding_window`) attends per request over the keys of its queries' windows
(paged_attention_ref with a window): none of the plans below, which read whole prefixes.

Groups: the scheduler orders a batch so that requests sharing a cached radix prefix sit together and says so in
fb.groups; each group with a shared prefix runs the reference's cascade on its own (the prefix's K/V read once
for the group), so a batch mixing several few-shot prefixes (MMLU subjects) still reads each prefix once.

Decode and short extends (select's choices, a few-shot question after its cached examples) on the CPU with
float32 KV run our C kernel (kernels/native.py: `paged_decode`) when it could be built: one call per layer for
the whole batch, one query row at a time, reads every row's keys in place through req_to_token (no gathered
copy, any fragmentation: a cached prefix, a new turn, decode slots), split into chunks so that a lone long
request uses every thread; a group sharing a cached prefix reads the prefix once (torch's flash kernel over
it for all the group's rows, a view when its slots are one run) and merges it with the kernel's partials.

Without the kernel, decode without a batch-wide shared prefix takes the view route: a request's KV slots are
mostly one contiguous run (a prompt is allocated in one piece, and a lone request's decode slots follow it), and
attending to a view of that run reads the pool in place instead of gathering a copy (`index_select` was the
largest non-GEMM cost of a CPU decode step: ~4.8 of ~25 ms at a 1k context). The head run is read as a view,
the rest of the slots (if any) gathered, and the two partials merged by log-sum-exp.
"""

from __future__ import annotations

import torch

from sgnb.engine.attention.base import AttentionBackend, AttentionLayer
from sgnb.engine.forward_batch import ForwardBatch, ForwardMode
from sgnb.kernels.attention import attend_with_lse, merge_partials, paged_attention_ref

MIN_VIEW_RUN = 64  # a contiguous head run shorter than this is gathered with the rest


# an extend takes the kernel, one query row per token, when each of its rows reads at most this many keys of
# its own (past a shared prefix read once for its group): select's choices and short answers after few-shot
# examples. Longer own parts go faster through torch's SDPA over a gathered copy (single-thread CPU time on the
# 2-core EPYC, per layer: 4 requests x 5 tokens after a shared 600 0.48 vs 0.74 ms, 32 x 40 after 480: 19.9 vs
# 23.3; but a lone 32-token turn over 1k: 2.5 vs 1.2, 16 lone 8-token extends over 300: 3.7 vs 2.8)
NATIVE_MAX_OWN_KEYS = 96


def _groups(fb: ForwardBatch) -> list[tuple[int, int, int]]:
    B = fb.batch_size
    return fb.groups or ([(0, B, fb.shared_len)] if fb.shared_len else [(i, 1, 0) for i in range(B)])


def _cascade_shared(fb: ForwardBatch) -> list[int]:
    """Per request, the shared prefix its group reads once (0: none). The scheduler shares only prefixes long
    enough to be worth it (scheduler.MIN_SHARED_PREFIX), as the reference's cascade takes them."""
    shared_of = [0] * fb.batch_size
    for a, n, shared in _groups(fb):
        if n > 1 and shared:
            shared_of[a: a + n] = [shared] * n
    return shared_of


class _NativePlan:
    """A forward's plan for the C kernel, one query row at a time (a decode's one token, or each token of a
    short extend: row j of a request with prefix p sees its first p + j + 1 keys): every row's keys outside
    a shared prefix in one call, then per group that shares a cached prefix, the prefix once for all its rows.
    rows / starts / lens (T,) int64 for the kernel; cascades holds (first row, row count, the prefix's first
    slot if its slots are one run else its slot ids, its length)."""

    __slots__ = ("rows", "starts", "lens", "cascades")

    def __init__(self, fb: ForwardBatch, shared_of: list[int]) -> None:
        self.cascades: list[tuple[int, int, int | torch.Tensor, int]] = []
        offsets = [0]
        for n in fb.extend_lens_cpu:
            offsets.append(offsets[-1] + n)
        for a, n, _ in _groups(fb):
            shared = shared_of[a]
            if shared:
                slots = fb.req_to_token[fb.req_pool_indices_cpu[a], :shared]
                run = bool((slots[1:] - slots[:-1] == 1).all()) if shared > 1 else True
                self.cascades.append((offsets[a], offsets[a + n] - offsets[a], int(slots[0]) if run else slots,
                                      shared))
        rows: list[int] = []
        starts: list[int] = []
        lens: list[int] = []
        for i in range(fb.batch_size):
            prefix, ext, start = fb.prefix_lens_cpu[i], fb.extend_lens_cpu[i], shared_of[i]
            rows += [fb.req_pool_indices_cpu[i]] * ext
            starts += [start] * ext
            lens += range(prefix + 1 - start, prefix + ext + 1 - start)
        self.rows = torch.tensor(rows, dtype=torch.int64)
        self.starts = torch.tensor(starts, dtype=torch.int64)
        self.lens = torch.tensor(lens, dtype=torch.int64)


def _native_plan(fb: ForwardBatch, kv_dtype: torch.dtype, heads: int, kv_heads: int,
                 head_dim: int) -> _NativePlan | None:
    """The kernel's plan for this forward, or None where torch's kernels do better or the kernel cannot run."""
    if fb.input_ids.device.type != "cpu" or kv_dtype != torch.float32 or heads % kv_heads or head_dim % 8:
        return None
    from sgnb.kernels import native

    if heads // kv_heads > native.MAX_GROUP or not native.available():
        return None
    shared_of = _cascade_shared(fb)
    if fb.mode is not ForwardMode.DECODE:
        own = (p + e - s for p, e, s in zip(fb.prefix_lens_cpu, fb.extend_lens_cpu, shared_of))
        if max(own) > NATIVE_MAX_OWN_KEYS:
            return None
    return _NativePlan(fb, shared_of)


class TorchAttention(AttentionBackend):
    """Per-request SDPA over gathered K/V; a cascade per group of requests that share a radix prefix (fb.groups,
    or the batch-wide fb.shared_len); lone decode requests read a contiguous run of the pool in place."""

    name = "torch"

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        plan = _native_plan(fb, self.kv_cache.k_buffers[0].dtype, self.num_heads, self.num_kv_heads, self.head_dim)
        if plan is not None:
            fb.attn_metadata = plan
            return
        offsets = [0]
        for n in fb.extend_lens_cpu:
            offsets.append(offsets[-1] + n)
        views: dict[int, tuple[int, int, torch.Tensor]] = {}
        if fb.mode is ForwardMode.DECODE and fb.input_ids.device.type == "cpu" and not fb.shared_len:
            alone = range(fb.batch_size) if fb.groups is None else [a for a, n, s in fb.groups if n == 1]
            for i in alone:  # (first slot of the contiguous head run, its length, slots of the rest)
                slots = fb.req_to_token[fb.req_pool_indices_cpu[i], : fb.seq_lens_cpu[i]]
                breaks = (slots[1:] - slots[:-1] != 1).nonzero()
                head = int(breaks[0]) + 1 if len(breaks) else len(slots)
                if head >= MIN_VIEW_RUN:
                    views[i] = (int(slots[0]), head, slots[head:])
        fb.attn_metadata = (offsets, views)

    def attend(self, q: torch.Tensor, layer: AttentionLayer, fb: ForwardBatch) -> torch.Tensor:
        cache = self.kv_cache
        k_buf, v_buf = cache.k_buffers[layer.layer_id], cache.v_buffers[layer.layer_id]
        window = getattr(layer, "sliding_window", None)
        if window is not None:  # per request, the keys of its queries' windows only (no cascade, no plan)
            return paged_attention_ref(q, k_buf, v_buf, fb.req_to_token, fb.req_pool_indices_cpu,
                                       fb.prefix_lens_cpu, fb.extend_lens_cpu, layer.scale, window=window)
        if isinstance(fb.attn_metadata, _NativePlan):
            return self._native(q, k_buf, v_buf, fb.req_to_token, fb.attn_metadata, layer.scale)
        views: dict[int, tuple[int, int, torch.Tensor]]
        offsets, views = fb.attn_metadata
        if fb.groups is None and not views:
            return paged_attention_ref(q, k_buf, v_buf, fb.req_to_token, fb.req_pool_indices_cpu,
                                       fb.prefix_lens_cpu, fb.extend_lens_cpu, layer.scale, fb.shared_len)
        groups = fb.groups or [(i, 1, 0) for i in range(fb.batch_size)]
        out = torch.empty_like(q)
        for a, n, shared in groups:
            t0, t1 = offsets[a], offsets[a + n]
            if n == 1 and a in views:
                out[t0] = self._decode_view(q[t0], k_buf, v_buf, *views[a], layer.scale)
            else:
                out[t0:t1] = paged_attention_ref(
                    q[t0:t1], k_buf, v_buf, fb.req_to_token, fb.req_pool_indices_cpu[a: a + n],
                    fb.prefix_lens_cpu[a: a + n], fb.extend_lens_cpu[a: a + n], layer.scale, shared)
        return out

    @staticmethod
    def _decode_view(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, start: int, head: int,
                     rest: torch.Tensor, scale: float) -> torch.Tensor:
        """One decode query (H, D) over the view k_buf[start: start + head] and the gathered `rest` slots."""
        H, D = q.shape
        Hkv = k_buf.shape[1]
        qi = q.view(Hkv, H // Hkv, 1, D)  # (Hkv, G, 1, D): the G query heads of a KV head as rows
        k = k_buf[start: start + head].transpose(0, 1)  # (Hkv, head, D), a view of the pool
        v = v_buf[start: start + head].transpose(0, 1)
        o, lse = attend_with_lse(qi, k, v, scale, None)  # (Hkv, G, 1, D), (Hkv, G, 1)
        if len(rest):
            o2, lse2 = attend_with_lse(qi, k_buf[rest].transpose(0, 1), v_buf[rest].transpose(0, 1), scale, None)
            o = merge_partials(o, lse, o2, lse2)
        return o.reshape(H, D)

    def _native(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, req_to_token: torch.Tensor,
                plan: _NativePlan, scale: float) -> torch.Tensor:
        from sgnb.kernels import native

        B, H, D = q.shape
        dtype = q.dtype
        q = q.float().contiguous()  # a no-op for the float32 model (a bf16 one on float32 KV: converted)
        out, lse = native.paged_decode(q, k_buf, v_buf, req_to_token, plan.rows, plan.starts, plan.lens, scale)
        if not plan.cascades:
            return out.to(dtype)
        Hkv = k_buf.shape[1]
        for a, n, prefix, shared in plan.cascades:
            if isinstance(prefix, int):
                k, v = k_buf[prefix: prefix + shared], v_buf[prefix: prefix + shared]  # views of the pool
            else:
                k, v = k_buf.index_select(0, prefix), v_buf.index_select(0, prefix)
            qg = q[a: a + n].view(n, Hkv, H // Hkv, D).permute(1, 2, 0, 3)  # (Hkv, G, n, D)
            o1, l1 = attend_with_lse(qg, k.transpose(0, 1), v.transpose(0, 1), scale, None)
            o1 = o1.permute(2, 0, 1, 3).reshape(n, H, D)
            l1 = l1.permute(2, 0, 1).reshape(n, H)
            out[a: a + n] = merge_partials(o1, l1, out[a: a + n], lse[a: a + n])
        return out.to(dtype)
