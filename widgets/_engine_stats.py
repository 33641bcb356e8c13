"""EngineStats: the engine's hit rate, throughput, KV pool occupancy and queues, with small live charts.

A Ticker thread polls `engine.get_stats()` at <= 4 Hz (a read of counters; the engine does nothing for it) and
syncs `stats` (the latest dict) and `history` (one short series per chart) in one message, only when something
changed, so an idle engine costs no messages. The drawing and the field list are in `stats_draw.js`.
"""

from __future__ import annotations

import threading
from typing import Any

import anywidget
import traitlets

from sgnb.widgets._esm import bundle
from sgnb.widgets._series import SERIES, StatsHistory  # noqa: F401 (SERIES re-exported)
from sgnb.widgets._series import stats_point as _point  # noqa: F401 (the tests read it here)
from sgnb.widgets._ticker import Ticker


class EngineStats(anywidget.AnyWidget):
    """Live engine statistics: `EngineStats(engine, interval=0.5, points=120)`; `.detach()` stops polling.

    `stats` is the latest `engine.get_stats()`; `history[name]` the last `points` samples of each series in
    `SERIES` (hit_rate per interval in [0, 1], tokens/s, KV fractions in [0, 1], queue lengths).
    """

    _esm = bundle("engine_stats.js")

    stats = traitlets.Dict().tag(sync=True)
    history = traitlets.Dict().tag(sync=True)

    def __init__(self, engine: Any, *, interval: float = 0.5, points: int = 120, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.engine = engine
        self.points = points
        self.polls = 0
        self.flushes = 0
        self._lock = threading.Lock()
        self._history = StatsHistory(points)
        self._ticker = Ticker(self.poll, max(interval, 0.25), "sgnb-engine-stats")  # <= 4 Hz
        self.poll()
        self._ticker.start()

    def poll(self) -> bool:
        """Read the engine's stats now; sync (one message) when they changed. Returns whether they did."""
        with self._lock:
            stats = self.engine.get_stats()
            self.polls += 1
            if not self._history.add(stats):
                return False
            history = self._history.lists()
            with self.hold_sync():
                self.stats = dict(stats)
                self.history = history
            self.flushes += 1
            return True

    def detach(self) -> None:
        """Stop polling; the last numbers stay."""
        self._ticker.stop()

    @property
    def attached(self) -> bool:
        return self._ticker.running

    def close(self) -> None:
        self.detach()
        super().close()

    def __repr__(self) -> str:
        s = self.stats
        return (f"<EngineStats hit rate {s.get('cache_hit_rate', 0.0):.0%}, "
                f"{s.get('gen_tokens_per_s', 0.0):.1f} tok/s, KV {s.get('kv_used', 0)}/{s.get('kv_total', 0)}, "
                f"{s.get('waiting', 0)} waiting, {s.get('running', 0)} running>")

    def _repr_mimebundle_(self, **kwargs: Any) -> tuple[dict, dict] | None:
        """The widget view, a short text/plain and a static text/html snapshot (what a renderer without the
        widget shows: GitHub, nbviewer, an exported page; see `_static.py`)."""
        from sgnb.widgets._static import with_snapshot

        return with_snapshot(self, super()._repr_mimebundle_(**kwargs))
