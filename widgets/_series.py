"""The engine-stats series both the EngineStats widget and the JupyterLab panel chart, defined once here, and
their history (no heavy imports)."""

from __future__ import annotations

from collections import deque
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


class StatsHistory:
    """The last `points` samples of every series, one sample per call of `add` with changed stats. Not
    thread-safe: the caller holds its own lock."""

    def __init__(self, points: int = 120) -> None:
        self.points = points
        self.stats: dict[str, Any] | None = None  # the latest stats added
        self.series: dict[str, deque[float]] = {k: deque(maxlen=points) for k in SERIES}

    def add(self, stats: dict[str, Any]) -> bool:
        """Sample `stats` (a `get_stats()` dict) if they differ from the latest; returns whether they did."""
        if stats == self.stats:
            return False
        hits = self.series["hit_rate"]
        for k, v in stats_point(self.stats, stats, hits[-1] if hits else 0.0).items():
            self.series[k].append(round(v, 4))
        self.stats = stats
        return True

    def lists(self) -> dict[str, list[float]]:
        """The series as lists: what stats_draw.js charts."""
        return {k: list(v) for k, v in self.series.items()}
