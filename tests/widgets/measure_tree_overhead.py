"""Engine throughput with and without a RadixTreeView attached (not a pytest test: a measurement to run by hand).

    python tests/widgets/measure_tree_overhead.py [--model smollm2] [--device cpu] [--pairs 10] [--requests 32]

Each pair runs the same workload twice, once with a view attached, in alternating order (so drift in the
machine's speed hits both sides alike): `requests` short prompts sharing a prefix, `max_new_tokens` tokens each
(ignore_eos, greedy), from an empty cache (flush_cache before each run). Reports the median of the paired
slowdowns and the CPU time the view's timer thread used as a share of the run's wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

from sgnb.engine import Engine
from sgnb.widgets import EngineStats, RadixTreeView

PREFIX = "You are a helpful assistant. Answer each question in one short sentence, please.\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--pairs", type=int, default=10)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--with-stats", action="store_true", help="attach an EngineStats too")
    ap.add_argument("--no-tree", action="store_true", help="attach no RadixTreeView (with --with-stats: stats alone)")
    args = ap.parse_args()

    engine = Engine(args.model, device=args.device, num_threads=args.threads)
    prompts = [PREFIX + f"Question {i}: what is {i} plus {i}?\nAnswer:" for i in range(args.requests)]
    params = {"max_new_tokens": args.max_new_tokens, "temperature": 0, "ignore_eos": True}

    tid = engine.scheduler.thread.native_id

    def scheduler_cpu() -> float:
        """CPU seconds the scheduler thread has used (Linux /proc; 0 elsewhere)."""
        try:
            fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def run() -> tuple[float, tuple[int, int], float]:
        """Wall seconds, the schedule (prefill batches, decode steps) and the scheduler thread's CPU seconds."""
        engine.flush_cache()
        s0, c0 = engine.get_stats(), scheduler_cpu()
        t0 = time.perf_counter()
        engine.generate(prompts, params)
        wall = time.perf_counter() - t0
        s1 = engine.get_stats()
        return wall, (s1["prefill_batches"] - s0["prefill_batches"], s1["decode_steps"] - s0["decode_steps"]), \
            scheduler_cpu() - c0

    for _ in range(2):  # warm up (allocations, CUDA graphs)
        run()
    base, viewed, slowdowns, same, shares, events, sched_cpu = [], [], [], [], [], [], {False: [], True: []}
    for i in range(args.pairs):
        times, plans = {}, {}
        for attached in ((False, True) if i % 2 == 0 else (True, False)):
            if not attached:
                times[False], plans[False], cpu = run()
                sched_cpu[False].append(cpu / times[False])
                continue
            view = None if args.no_tree else RadixTreeView(engine)
            stats = EngineStats(engine) if args.with_stats else None
            cpu0, seen0 = (view._ticker.cpu_seconds, view.events_seen) if view else (0.0, 0)
            times[True], plans[True], cpu = run()
            sched_cpu[True].append(cpu / times[True])
            time.sleep(0.1)
            cpu = (view._ticker.cpu_seconds - cpu0 if view else 0.0) + (stats._ticker.cpu_seconds if stats else 0.0)
            shares.append(cpu / times[True])
            if view is not None:
                view.detach()
                events.append(view.events_seen - seen0)
            if stats is not None:
                stats.detach()
        base.append(times[False])
        viewed.append(times[True])
        slowdowns.append(times[True] / times[False] - 1)
        if plans[False] == plans[True]:  # the same schedule: the cleanest comparison
            same.append(slowdowns[-1])
    tokens = args.requests * args.max_new_tokens
    print(json.dumps({
        "model": engine.model_name, "device": str(engine.runner.device), "host": platform.node(),
        "requests": args.requests, "max_new_tokens": args.max_new_tokens, "pairs": args.pairs,
        "with_stats": args.with_stats, "tree": not args.no_tree, "events_per_run": statistics.median(events) if events else None,
        "base_s": [round(x, 4) for x in base], "view_s": [round(x, 4) for x in viewed],
        "base_tok_s": round(tokens / statistics.median(base), 1),
        "view_tok_s": round(tokens / statistics.median(viewed), 1),
        "median_slowdown_pct": round(100 * statistics.median(slowdowns), 2),
        "mean_slowdown_pct": round(100 * statistics.mean(slowdowns), 2),
        "same_schedule_pairs": len(same),
        "same_schedule_median_slowdown_pct": round(100 * statistics.median(same), 2) if same else None,
        "view_thread_cpu_pct_of_wall": round(100 * statistics.median(shares), 3),
        "scheduler_cpu_pct_of_wall": {"base": round(100 * statistics.median(sched_cpu[False]), 1),
                                      "view": round(100 * statistics.median(sched_cpu[True]), 1)},
    }, indent=1))
    engine.shutdown()


if __name__ == "__main__":
    main()
