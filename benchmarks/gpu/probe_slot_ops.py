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
    """The ops on `lib`'s arrays ("numpy", or "torch" on `device`), by name."""
    if lib == "numpy":
        arr, copy, cat = (lambda x: np.asarray(x, dtype=np.int64)), np.copy, np.concatenate
        table = np.zeros((512, 4096), dtype=np.int64)
    else:
        arr, copy, cat = (lambda x: torch.as_tensor(x, dtype=torch.int64, device=device)), torch.clone, torch.cat
        table = torch.zeros(512, 4096, dtype=torch.int64, device=device)
    slots, free = arr(range(1, 201)), arr(range(1, 100_001))
    rows, cols, pts = arr(range(64)), arr([100] * 64), arr(range(64))
    return {"row write": lambda: table.__setitem__((7, slice(100, 300)), slots),
            "clone": lambda: copy(slots[50:]),
            "cat of 3": lambda: cat([slots, slots[:40], slots[:9]]),
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
