"""Decode's linears (Llama-2-7B shapes, bf16) with cuBLAS's default algorithm vs the one PyTorch's TunableOp
picks by timing every candidate (torch.cuda.tunable): whether tuning the GEMMs per batch size could beat the
heuristics where the decode step is behind (batch 128) or above the floor (batch 1).

    python benchmarks/gpu/gemm_tunableop.py [--batches 1,8,64,128] [--reps 200] [--out FILE]

Each shape is timed as F.linear(x, W) in a CUDA graph of `reps` back-to-back calls (no launch gaps), with W
cycling through copies bigger than the L2 cache; GB/s counts the weight bytes (the decode floor's terms).
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F
from decode_split_sweep import graph_us  # this folder: on sys.path when run as a script

SHAPES = {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008),
          "lm_head": (49152, 4096)}


def time_linear(x: torch.Tensor, ws: list[torch.Tensor], reps: int) -> float:
    """Microseconds per call, cycling through copies of W so no call reads a weight from L2 (decode_split_sweep's
    graph timing: `reps` calls in one CUDA graph, the best of a few replays)."""
    copies = itertools.cycle(ws)
    return graph_us(lambda: F.linear(x, next(copies)), calls=reps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8,64,128")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--out")
    args = ap.parse_args()
    tun = torch.cuda.tunable
    tun.set_filename("/tmp/tunableop_results.csv")
    if hasattr(tun, "set_rotating_buffer_size"):
        tun.set_rotating_buffer_size(256)  # MB: candidates are timed on weights past the L2 cache, as decode reads
    rows = []
    for name, (n, k) in SHAPES.items():
        copies = max(2, -(-(200 << 20) // (n * k * 2)))  # > 200 MB of weights in rotation: past the 60 MB L2
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        for m in [int(b) for b in args.batches.split(",")]:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            tun.enable(False)
            default_us = time_linear(x, ws, args.reps)
            tun.enable(True)
            tun.tuning_enable(True)
            tun.set_max_tuning_duration(30)
            tun.set_max_tuning_iterations(100)
            ref = F.linear(x, ws[0])  # tunes this shape (eagerly, outside any graph)
            torch.cuda.synchronize()
            tun.tuning_enable(False)
            tuned_us = time_linear(x, ws, args.reps)
            tun.enable(False)
            diff = (F.linear(x, ws[0]).float() - ref.float()).abs().max().item()
            gb = n * k * 2 / 1e9
            row = {"shape": name, "n": n, "k": k, "m": m, "default_us": round(default_us, 2),
                   "tuned_us": round(tuned_us, 2), "default_tbps": round(gb / default_us * 1e3, 2),
                   "tuned_tbps": round(gb / tuned_us * 1e3, 2), "max_abs_diff": diff}
            rows.append(row)
            print(json.dumps(row), flush=True)
        del ws
        torch.cuda.empty_cache()
    results = tun.get_results() if hasattr(tun, "get_results") else None
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows, "tunableop_results": [list(map(str, r)) for r in results or []]}, f, indent=1)


if __name__ == "__main__":
    main()
