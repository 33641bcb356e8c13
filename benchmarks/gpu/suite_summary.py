"""One line per (workload, system) of a bench_suite JSON, for a device call's output tail.

    python3 benchmarks/gpu/suite_summary.py $OUT/suite.json
"""

import json
import sys

try:
    d = json.load(open(sys.argv[1]))
except Exception as e:  # the suite was cut short before writing anything
    raise SystemExit(f"no {sys.argv[1]}: {e}") from None
for w in d.get("workloads", []):
    print(w["name"], w["system"], w.get("status"), round(w.get("programs_per_s") or 0, 3), "p50", w.get("latency_p50_s"),
          "p99", w.get("latency_p99_s"), "rounds", w.get("engine_rounds"), "fwd_s", w.get("forward_seconds"),
          "steps", w.get("decode_steps"), "wall", w.get("wall_s"), "hit", w.get("cache_hit_rate"),
          "opt", w.get("optimal_cache_hit_rate"), "eager_s", w.get("eager_forward_seconds"),
          "sgnb_x", w.get("sgnb_speedup"), "compiles", w.get("triton_compiles"))
    for f in w.get("slowest_forwards") or []:
        print("    slow", f["seconds"], f["forward"])
