r"""Who holds the interpreter lock while a suite workload runs: py-spy `--gil` samples grouped by thread.

    python benchmarks/gpu/gil_profile.py --workload hellaswag [--scale gpu] [--model dummy:llama-2-7b-smolvocab]
        [--tokenizer DIR] [--runs 3] [--rate 250] [--top 25] [--out FILE]

Runs the workload once untimed (compiles, graph warm-up), then attaches `py-spy record --gil` to this process
(py-spy on PATH or in $PYSPY; attaching needs ptrace rights: root, or kernel.yama.ptrace_scope 0) for --runs timed
runs, each after a cache flush. Every sample is a moment some thread held the GIL; samples are grouped by thread:
"scheduler" (the engine's thread), "program" (the program pool's threads: the interpreter running gens and selects),
"batch" (run_batch's workers and the main thread: binding arguments, running the program bodies, waiting) and
"frameless" (a thread that held the GIL with no Python frame). Prints, per run, the GIL-held milliseconds of each
group, the top functions of each (inclusive), and the scheduler's phase wall and CPU seconds of the same runs.
On a 2-core machine a thread the OS has descheduled still holds the GIL: read shares there, not milliseconds.
On the device: put py-spy's manylinux wheel in .whl (setup.sh installs it into /tmp/site) and run the step with
PYSPY=/tmp/site/bin/py-spy, e.g. `"script gil 200 benchmarks/gpu/gil_profile.py --workload hellaswag --tokenizer
.gpu/smollm2 --out \$OUT/gil.json"`.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE))
from common import add_workload_args, workload_and_runtime  # noqa: E402


def group_of(frames: list[str]) -> str:
    if not frames or frames == [""]:
        return "frameless"
    if any("Scheduler._loop" in f for f in frames):
        return "scheduler"
    if any("_ProgramPool._run" in f for f in frames):
        return "program"
    return "batch"


def summarize(raw: Path, runs: int, rate: float, top: int) -> dict:
    """py-spy's raw output (one line per distinct stack: frames joined by ';', then a count) as GIL-held ms per
    run by thread group, and each group's top functions (inclusive ms per run)."""
    ms = 1000.0 / rate / runs
    groups: collections.Counter = collections.Counter()
    funcs: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        frames = stack.split(";") if stack else []
        group, n = group_of(frames), int(count)
        groups[group] += n
        # "func (path/file.py:line)" -> "func file.py": a function counted once per sample however deep it recurs
        for name in {f.split(" (")[0] + " " + f.rsplit("/", 1)[-1].split(":")[0] for f in frames if f}:
            funcs[group][name] += n
    return {"gil_held_ms_per_run": {g: round(n * ms, 1) for g, n in groups.most_common()},
            "top_functions_ms_per_run": {g: [[name, round(n * ms, 1)] for name, n in c.most_common(top)
                                             if "_bootstrap" not in name and "Thread.run" not in name]
                                         for g, c in funcs.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_args(ap)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--rate", type=int, default=250, help="samples a second")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out")
    args = ap.parse_args()
    pyspy = os.environ.get("PYSPY") or shutil.which("py-spy")
    if not pyspy:
        sys.exit("py-spy not found: pip install py-spy (or set $PYSPY)")
    wl, rt = workload_and_runtime(args)
    engine = rt.engine
    raw = Path(tempfile.mkdtemp()) / "gil.txt"
    try:
        wl.program.run_batch(wl.args, backend=rt, temperature=0.0, num_threads=args.threads)  # untimed
        spy = subprocess.Popen([pyspy, "record", "--gil", "--nonblocking", "--format", "raw", "-r", str(args.rate),
                                "-o", str(raw), "-p", str(os.getpid())], stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
        time.sleep(1.0)  # attached
        if spy.poll() is not None:
            sys.exit(f"py-spy could not attach: {spy.stderr.read()[-2000:] if spy.stderr else ''}")
        walls = []
        before = engine.get_stats()
        for _ in range(args.runs):
            engine.flush_cache()
            t0 = time.perf_counter()
            wl.program.run_batch(wl.args, backend=rt, temperature=0.0, num_threads=args.threads)
            walls.append(round(time.perf_counter() - t0, 3))
        after = engine.get_stats()
        spy.send_signal(signal.SIGINT)  # py-spy writes its samples when interrupted
        spy.wait(timeout=60)
    finally:
        rt.shutdown()
    phases = {k: round((v - before["phase_seconds"][k]) / args.runs, 3) for k, v in after["phase_seconds"].items()}
    phase_cpu = {k: round((v - before["phase_cpu_seconds"][k]) / args.runs, 3)
                 for k, v in after["phase_cpu_seconds"].items()}
    result = {"workload": args.workload, "scale": args.scale, "model": args.model, "runs": args.runs,
              "walls_s": walls, "programs_per_s": round(len(wl.args) * len(walls) / sum(walls), 2),
              "phase_seconds_per_run": phases, "phase_cpu_seconds_per_run": phase_cpu,
              **summarize(raw, args.runs, args.rate, args.top)}
    print(json.dumps({k: v for k, v in result.items() if k != "top_functions_ms_per_run"}))
    for group, rows in result["top_functions_ms_per_run"].items():
        print(f"-- {group} (GIL-held ms per run, inclusive)")
        for name, ms in rows:
            print(f"  {ms:8.1f}  {name}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
