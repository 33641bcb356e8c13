"""The engine-stats series both the EngineStats widget and the JupyterLab panel chart (no heavy imports)."""

from __future__ import annotations

from typing import Any

# the charted series: name -> how to read it from two successive get_stats() dicts (previous may be None)
SERIES = ("hit_rate", "gen_tokens_per_s", "prefill_tokens_per_s", "kv_used_frac", "kv_cached_frac", "waiting",
          "running")


def stats_point(prev: dict[str, Any] | None, cur: dict[str, Any], last_hit: float) -> dict[str, float]:
    """One sample of every series. hit_rate is over the last poll interval (cached / prompt tokens that
    arrived since), kept from the previous sample when no prompt arrived."""
    d_prompt = cur.get("prompt_tokens", 0) - (prev or {}).get("prompt_tokens", 0)
    d_cached = cur.get("cached_tokens", 0) - (prev or {}).get("cached_tokens", 0)
    total = max(cur.get("kv_total", 0), 1)
    return {
        "hit_rate": d_cached / d_prompt if prev is not None and d_prompt > 0 else last_hit,
        "gen_tokens_per_s": float(cur.get("gen_tokens_per_s", 0.0)),
        "prefill_tokens_per_s": float(cur.get("prefill_tokens_per_s", 0.0)),
        "kv_used_frac": cur.get("kv_used", 0) / total,
        "kv_cached_frac": cur.get("kv_cached", 0) / total,
        "waiting": float(cur.get("waiting", 0)),
        "running": float(cur.get("running", 0)),
    }
