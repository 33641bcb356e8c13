"""The engine's statistics, as `Engine.get_stats` gives them: what it runs on, its queues, the scheduler's
counters (requests, tokens, forwards, phases), throughput over the last 5 s, the KV pool and the radix cache.

Safe from any thread; it takes no lock of the scheduler's: the numbers are read one by one while the scheduler
runs, so one dict may mix values of consecutive rounds.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from sgnb.engine.request import ReqStatus

if TYPE_CHECKING:
    from sgnb.engine.engine import Engine
    from sgnb.engine.model_runner import Runner

THROUGHPUT_WINDOW_S = 5.0  # the tokens/s figures average over the steps of this last span


def engine_stats(engine: Engine) -> dict[str, Any]:
    """The stats dict (see the module's contract)."""
    s = engine.scheduler
    c = s.counters
    now = time.perf_counter()
    window = [x for x in list(c.recent) if now - x[0] <= THROUGHPUT_WINDOW_S]
    span = max(now - window[0][0], 1e-3) if window else 1.0
    pool = engine.runner.kv_pool
    return {
        "model": engine.source.name,
        "device": engine.runner.placement,
        "attention_backend": engine.runner.attention_backend,
        "cuda_graph": graph_stats(engine.runner),
        "warmup_seconds": engine.warmup_seconds,
        "memory": getattr(engine.runner, "memory", None),
        "quantization": engine.runner.quantization,
        "tp_size": engine.config.tp_size,
        "waiting": len(s.waiting) + s.count(ReqStatus.CHUNKED),
        "running": s.count(ReqStatus.RUNNING) + s.count(ReqStatus.EXTENDING),
        "requests_finished": c.requests_finished,
        "requests_aborted": c.requests_aborted,
        "requests_failed": c.requests_failed,
        "prompt_tokens": c.prompt_tokens,
        "cached_tokens": c.cached_tokens,
        "cache_hit_rate": c.cached_tokens / c.prompt_tokens if c.prompt_tokens else 0.0,
        "prefill_tokens": c.prefill_tokens,
        "generated_tokens": c.generated_tokens,
        "decode_steps": c.decode_steps,
        "prefill_batches": c.prefill_batches,
        "retractions": c.retractions,
        "forward_seconds": c.forward_seconds,
        "decode_seconds": c.decode_seconds,
        "cascade_batches": c.cascade_batches,
        "graphed_forwards": c.graphed_forwards,
        "eager_forwards": c.eager_forwards,
        "eager_forward_seconds": c.eager_seconds,
        "slowest_forwards": [{"seconds": round(t, 4), "forward": d} for t, d in c.slowest],
        "overlap_schedule": s.overlap,
        "overlapped_steps": c.overlapped_steps,
        "overlapped_prefills": c.overlapped_prefills,
        "follow_up_waits": c.follow_up_waits,
        "mixed_batches": c.mixed_batches,
        "gen_tokens_per_s": sum(x[1] for x in window) / span if window else 0.0,
        "prefill_tokens_per_s": sum(x[2] for x in window) / span if window else 0.0,
        "kv_total": pool.size,
        "kv_free": pool.available,
        "kv_cached": engine.tree.total_size,
        "kv_used": pool.size - pool.available,
        "kv_evictable": engine.tree.evictable_size,
        "kv_protected": engine.tree.protected_size,
        "radix_host_seconds": engine.tree.host_seconds,
        # the device's computing time (forwards, sampling, prompt logprobs; engine/device_time.py): against
        # the wall, how much the device waited on the host
        "device_seconds": s.device_time.collect(),
        "scheduler_cpu_seconds": c.thread_cpu_seconds,
        "phase_seconds": dict(c.phases),
        "phase_cpu_seconds": dict(c.phase_cpu),
        "new_token_ratio": s.new_token_ratio,
    }


def graph_stats(runner: Runner) -> dict | None:
    """The decode graphs' description (batch sizes, capture time, replays), with the extend graphs' under
    "extend" (None when they are off); None when no graphs run."""
    graphs = getattr(runner, "graphs", None)
    if graphs is None:
        return None
    extend = getattr(runner, "extend_graphs", None)
    return {**graphs.describe(), "extend": extend.describe() if extend is not None else None}
