"""Where the scheduler thread's time goes on one suite workload: cProfile around every `Scheduler.step`.

    python benchmarks/gpu/profile_scheduler.py --workload json_jump_forward [--scale gpu]
        [--model dummy:llama-2-7b-smolvocab] [--tokenizer DIR] [--engine-args JSON] [--top 40] [--out FILE]

Runs the workload once untimed (compiles, graph warm-up, grammar compile), flushes the cache, then once under the
profiler, with the suite's 64 program threads. Prints the wall time, rounds, the engine's forward seconds and
cProfile's cumulative and own-time tables for the scheduler thread only (the program threads are not profiled:
what they cost shows as the scheduler's wall time outside its own CPU work). cProfile slows Python code ~1.5-2x,
so read shares, not absolute times.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE))
from common import add_workload_args, workload_and_runtime  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_args(ap)
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--out")
    args = ap.parse_args()

    from sgnb.engine import scheduler as sched

    prof = cProfile.Profile()
    on = [False]
    step = sched.Scheduler.step

    def profiled_step(self, *a, **k):
        if not on[0]:
            return step(self, *a, **k)
        prof.enable()
        try:
            return step(self, *a, **k)
        finally:
            prof.disable()

    sched.Scheduler.step = profiled_step
    wl, rt = workload_and_runtime(args)
    engine = rt.engine
    try:
        wl.program.run_batch(wl.args, backend=rt, temperature=0.0, num_threads=args.threads)  # untimed
        engine.flush_cache()
        before = engine.get_stats()
        on[0] = True
        t0 = time.perf_counter()
        states = wl.program.run_batch(wl.args, backend=rt, temperature=0.0, num_threads=args.threads)
        wall = time.perf_counter() - t0
        on[0] = False
        after = engine.get_stats()
    finally:
        rt.shutdown()
    delta = {k: round(after[k] - before.get(k, 0), 4) for k in
             ("prefill_batches", "decode_steps", "forward_seconds", "decode_seconds", "radix_host_seconds",
              "graphed_forwards", "eager_forwards", "mixed_batches") if isinstance(after.get(k), (int, float))}
    delta["phase_seconds"] = {k: round(v - before["phase_seconds"].get(k, 0.0), 3)
                              for k, v in after["phase_seconds"].items()}
    summary = {"workload": args.workload, "model": args.model, "wall_s": round(wall, 3),
               "programs_per_s": round(len(wl.args) / wall, 2),
               "errors": sum(s.error() is not None for s in states), **delta}
    print(json.dumps(summary))
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("cumulative").print_stats(args.top)
    stats.sort_stats("tottime").print_stats(args.top)
    if os.environ.get("PROFILE_CALLERS"):
        stats.print_callers(os.environ["PROFILE_CALLERS"])
    if os.environ.get("PROFILE_CALLEES"):
        stats.print_callees(os.environ["PROFILE_CALLEES"])
    text = "\n".join(line for line in out.getvalue().splitlines() if line.strip())
    print(text)
    if args.out:
        Path(args.out).write_text(json.dumps({**summary, "profile": text}, indent=1))


if __name__ == "__main__":
    main()
