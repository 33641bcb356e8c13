"""One line per (workload, system) of a bench_suite JSON, for a device call's output tail (run.sh's suite steps,
ab_suite.py's runs): programs/s, the sgnb speed-up, hit rate vs its optimum, latency, wall, the device's busy share,
the engine's rounds, forward and decode time, the scheduler's and the process's CPU seconds, the phases (wall and CPU), Triton compiles inside
the run, and the slowest forwards.

    python3 benchmarks/gpu/suite_summary.py $OUT/suite.json
"""

from __future__ import annotations

import json
import sys


def line(w: dict, tag: str = "") -> str:
    """The summary line of one workload row of the suite's JSON, prefixed by `tag` (e.g. "base")."""
    out = " ".join(str(x) for x in (
        *([tag] if tag else []), w["name"], w["system"], w.get("status"), round(w.get("programs_per_s") or 0, 3),
        "sgnb_x", w.get("sgnb_speedup"), "hit", w.get("cache_hit_rate"), "opt", w.get("optimal_cache_hit_rate"),
        "p50", w.get("latency_p50_s"), "p99", w.get("latency_p99_s"), "wall", w.get("wall_s"),
        "busy", w.get("device_busy_share"), "rounds", w.get("engine_rounds"), "fwd_s", w.get("forward_seconds"),
        "eager_s", w.get("eager_forward_seconds"), "steps", w.get("decode_steps"),
        "sched_cpu", w.get("scheduler_cpu_seconds"), "proc_cpu", w.get("process_cpu_seconds"),
        "phases", w.get("phase_seconds"), "cpu", w.get("phase_cpu_seconds"), "compiles", w.get("triton_compiles")))
    for f in w.get("slowest_forwards") or []:
        out += f"\n    slow {f['seconds']} {f['forward']}"
    return out


def main() -> None:
    try:
        d = json.load(open(sys.argv[1]))
    except Exception as e:  # the suite was cut short before writing anything
        raise SystemExit(f"no {sys.argv[1]}: {e}") from None
    for w in d.get("workloads", []):
        print(line(w))


if __name__ == "__main__":
    main()
