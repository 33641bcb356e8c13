"""The suite at GPU scale on two engines in one call: the carried tree ("new") and a base commit's engine/ ("base"),
alternated (base, new, new, base by default), each run in its own process, so a change is measured against its
base on the same machine.

    git archive BASE engine | tar -x -C .gpu/base            # before the call: the base's engine/ (carried in .gpu)
    python3 benchmarks/gpu/ab_suite.py --base .gpu/base --workloads hellaswag,mmlu [--new-systems sgnb,sgnb-gc-700]
        [--order base,new,new,base] [--model dummy:llama-2-7b-smolvocab] [--tokenizer .gpu/smollm2] [--scale gpu]
        [--timeout 160] [--engine-args JSON] --out-dir $OUT

Only engine/ differs between the two (the base package is the carried tree laid out as the package, with the
base's engine/ in place of its own): a change outside engine/ needs its own base. Each run is `bench_suite.py --warm`;
its JSON goes to OUT-DIR/ab_<i>_<which>.json and one line per (workload, system) to stdout (suite_summary.py's,
tagged base or new).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from suite_summary import line  # noqa: E402

sys.path.insert(0, str(ROOT / ".ci"))
from package_tree import lay_out  # noqa: E402


def base_package(base: Path, into: Path) -> Path:
    """The `sgnb` package with the base's engine/ (into/sgnb, laid out by .ci/package_tree.py)."""
    lay_out(into, {"engine": base / "engine"})
    return into


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, type=Path, help="a folder holding the base commit's engine/")
    ap.add_argument("--workloads", required=True)
    ap.add_argument("--new-systems", default="sgnb", help="suite systems of the new runs (the base runs sgnb)")
    ap.add_argument("--order", default="base,new,new,base")
    ap.add_argument("--model", default="dummy:llama-2-7b-smolvocab")
    ap.add_argument("--tokenizer", default=".gpu/smollm2")
    ap.add_argument("--scale", default="gpu")
    ap.add_argument("--timeout", type=float, default=160, help="seconds a run may take")
    ap.add_argument("--engine-args", default=None, help="JSON engine options for both engines' sgnb systems")
    ap.add_argument("--out-dir", required=True, type=Path)
    args = ap.parse_args()

    # on the device PYTHONPATH is /tmp/pkg (the carried tree as `sgnb`, setup.sh) and /tmp/site (the wheels);
    # elsewhere it may be empty: the new runs then import the installed sgnb
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    new = [p for p in paths if p.rstrip("/").endswith("/pkg")]
    site = [p for p in paths if p not in new]
    packages = {"base": [str(base_package(args.base, Path("/tmp/sgnb-ab-base")))], "new": new}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    # the base engine under the carried sgnb/ must import (2026-12-08, call 7: sgnb/ used a function the base
    # engine lacked; every base run failed and the new runs had nothing to be compared with)
    for which in sorted(set(args.order.split(","))):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([*packages[which], *site]))
        p = subprocess.run([sys.executable, "-P", "-c", "import sgnb, sgnb.engine.engine, sgnb.interpreter"],
                           env=env, capture_output=True, text=True, cwd=ROOT)
        if p.returncode:
            sys.exit(f"the {which} package does not import (a base engine must match the carried sgnb/):\n"
                     f"{p.stderr[-2000:]}")
    for i, which in enumerate(args.order.split(",")):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([*packages[which], *site]))
        out = args.out_dir / f"ab_{i}_{which}.json"
        cmd = [sys.executable, "-P", str(ROOT / "benchmarks" / "bench_suite.py"), "--scale", args.scale,
               "--model", args.model, "--workloads", args.workloads, "--warm", "--out", str(out),
               "--systems", "sgnb" if which == "base" else args.new_systems]
        if args.tokenizer:
            cmd += ["--tokenizer", args.tokenizer]
        if args.engine_args:
            cmd += ["--engine-args", args.engine_args]
        t0 = time.perf_counter()
        try:
            p = subprocess.run(cmd, env=env, timeout=args.timeout, capture_output=True, text=True, cwd=ROOT)
        except subprocess.TimeoutExpired:
            # the suite writes its JSON after each workload: what finished before the limit is still reported
            print(f"== {i} {which}: past {args.timeout:.0f} s", flush=True)
        else:
            print(f"== {i} {which} rc={p.returncode} {time.perf_counter() - t0:.0f} s", flush=True)
            if p.returncode:
                print(p.stdout[-1500:], p.stderr[-3000:], flush=True)
        if out.exists():
            for w in json.loads(out.read_text())["workloads"]:
                print(line(w, which), flush=True)


if __name__ == "__main__":
    main()
