"""Host cost of the KV-slot bookkeeping ops that the scheduler's cache path runs per request (issue 33): the same op
on a numpy array, a CPU torch tensor and (where there is one) a CUDA torch tensor, timed on the calling thread.

    python benchmarks/gpu/probe_slot_ops.py [--out FILE]

The ops, at the sizes hellaswag's requests see (a ~200-token row of a 512 x 4096 request table): a row write
(`req_to_token[row, a:b] = slots`), a clone of a slot slice (a new tree leaf's value), a concatenation of three
slices (a match over three nodes), a row view, a point write of 64 (row, column) pairs (a decode step) and a
free-list slice. CUDA ops are timed without a synchronize per op (as the scheduler issues them); one synchronize
closes each timing, so queued work is counted once. Prints a table; `--out` writes it as JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from datetime import date

import numpy as np
import torch


def ops(lib: str, device: str | None = None) -> dict:
    if lib == "numpy":
        table, slots = np.zeros((512, 4096), dtype=np.int64), np.arange(1, 201, dtype=np.int64)
        rows, cols, pts = np.arange(64), np.full(64, 100), np.arange(64)
        free = np.arange(1, 100_001, dtype=np.int64)
        return {"row write": lambda: table.__setitem__((7, slice(100, 300)), slots),
                "clone": lambda: slots[50:].copy(),
                "cat of 3": lambda: np.concatenate([slots, slots[:40], slots[:9]]),
                "row view": lambda: table[7, :300],
                "point write x64": lambda: table.__setitem__((rows, cols), pts),
                "free-list slice": lambda: free[:64]}
    table = torch.zeros(512, 4096, dtype=torch.int64, device=device)
    slots = torch.arange(1, 201, device=device)
    rows, cols = torch.arange(64, device=device), torch.full((64,), 100, device=device)
    pts, free = torch.arange(64, device=device), torch.arange(1, 100_001, device=device)
    return {"row write": lambda: table.__setitem__((7, slice(100, 300)), slots),
            "clone": lambda: slots[50:].clone(),
            "cat of 3": lambda: torch.cat([slots, slots[:40], slots[:9]]),
            "row view": lambda: table[7, :300],
            "point write x64": lambda: table.__setitem__((rows, cols), pts),
            "free-list slice": lambda: free[:64]}


def time_op(fn, sync, n: int = 5000) -> float:
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        sync()
        best = min(best, (time.perf_counter() - t0) / n)
    return best * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.set_num_threads(1)
    kinds = [("numpy", None), ("torch cpu", "cpu")] + ([("torch cuda", "cuda")] if torch.cuda.is_available() else [])
    table: dict[str, dict[str, float]] = {}
    for kind, device in kinds:
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        for name, fn in ops("numpy" if kind == "numpy" else "torch", device).items():
            fn()  # first call: allocations, lazy init
            sync()
            table.setdefault(name, {})[kind] = round(time_op(fn, sync), 2)
    cols = [k for k, _ in kinds]
    print(f"{'op (us per call)':18s}" + "".join(f"{c:>12s}" for c in cols))
    for name, row in table.items():
        print(f"{name:18s}" + "".join(f"{row[c]:12.2f}" for c in cols))
    if args.out:
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
        with open(args.out, "w") as f:
            json.dump({"date": date.today().isoformat(), "device": device, "torch": torch.__version__,
                       "numpy": np.__version__, "us_per_call": table}, f, indent=1)


if __name__ == "__main__":
    main()
