"""Tiles and block order of the Triton extend (prefill) attention on long prompts, then the engine's prefill row
with the fastest candidate. Run on a GPU machine:

    python3 benchmarks/gpu/extend_sweep.py --tokenizer .gpu/smollm2 --out $OUT/extend.json

Shapes (Llama-2-7B heads: 32 x 128, bf16, causal): a fresh 8k prompt the way the engine computes it (chunks of
`chunked_prefill_size` queries, each over everything before it), the same prompt in one pass, and 8 fresh 1k
prompts. Each candidate (BLOCK_M, BLOCK_N, warps, stages, reversed block order) is checked against the default
tiles' output, then timed with CUDA events (median of --reps). Rates count the causal mask's visible scores only.
Then `make bench-gpu`'s prefill row (bench_gpu.prefill_row) runs, each in its own process: with the 64 x 64 tiles
in order (before), with the module's long-run tiles (now), with the best candidate of the chunked 8k prompt,
and with the long-run tiles and one 8k chunk (chunked_prefill_size=8192).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE))

DEV, DTYPE = "cuda", torch.bfloat16  # --dry-run: the CPU, float32, Triton's interpreter, small shapes

# (BLOCK_M, BLOCK_N, num_warps, num_stages, reversed)
CANDIDATES = [
    (64, 64, 4, 3, False),  # the tiles before long runs had their own (the reference of max_abs_diff)
    (64, 64, 4, 3, True),
    (128, 64, 8, 3, False),
    (128, 64, 8, 3, True),
    (128, 128, 8, 3, True),
    (128, 32, 4, 3, True),
    (128, 64, 4, 3, True),
    (64, 128, 4, 3, True),
    (64, 64, 4, 4, True),
]


def case(n_req: int, q_len: int, prefix: int, H: int, D: int, g: torch.Generator):
    """Tensors for n_req requests of q_len new queries over `prefix` earlier keys each, contiguous slots."""
    L = prefix + q_len
    S = n_req * L + 1
    k = torch.randn(S, H, D, generator=g).to(DEV, DTYPE)
    v = torch.randn(S, H, D, generator=g).to(DEV, DTYPE)
    table = (torch.arange(n_req * L).view(n_req, L) + 1).to(DEV, torch.int32)
    rows = torch.arange(n_req, device=DEV)
    q = torch.randn(n_req * q_len, H, D, generator=g).to(DEV, DTYPE)
    qo = torch.arange(0, n_req * q_len + 1, q_len, device=DEV, dtype=torch.int32)
    ends = torch.full((n_req,), L, device=DEV, dtype=torch.int32)
    visible = n_req * (q_len * prefix + q_len * (q_len + 1) // 2)  # causal scores, bottom-right
    return (q, k, v, table, rows, qo, 0, ends, True, D**-0.5, q_len), 4 * visible * H * D


def run(args_tuple, cfg) -> torch.Tensor:
    from sgnb.kernels import extend_attention as ext

    bm, bn, w, st, rev = cfg
    ext.EXTEND_LONG_MIN, ext.EXTEND_LONG_TILES, ext.EXTEND_REVERSE = 1, (bm, bn, w, st), rev
    return ext.extend_attention(*args_tuple)


def time_ms(fn, reps: int) -> float:
    """Median milliseconds of fn: CUDA events (bench_attention's timer), or the wall clock on a --dry-run."""
    if DEV == "cuda":
        from bench_attention import _time_ms

        return _time_ms(fn, iters=reps)
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def engine_row(args: argparse.Namespace) -> None:
    """bench_gpu's prefill row with the long-run tiles and order of --engine-row's JSON; prints one JSON line."""
    from bench_gpu import prefill_row
    from common import matmul_peak_gflops

    from sgnb.kernels import extend_attention as ext

    spec = json.loads(args.engine_row)
    ext.EXTEND_LONG_TILES = tuple(spec["tiles"]) if spec["tiles"] else None
    ext.EXTEND_REVERSE = spec["reverse"]
    ns = argparse.Namespace(model=args.model, tokenizer=args.tokenizer,
                            engine_args=json.dumps(spec["engine_args"]) if spec["engine_args"] else None)
    r = prefill_row(ns, matmul_peak_gflops(device="cuda"))
    print(json.dumps({**spec, **{k: r[k] for k in ("tokens_per_s", "fraction_of_ceiling", "first_token_ms",
                                                   "attention_backend")}}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="dummy:llama-2-7b-smolvocab")
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--no-engine", action="store_true", help="the kernel sweep only")
    ap.add_argument("--dry-run", action="store_true", help="check the script on a CPU (TRITON_INTERPRET=1 set)")
    ap.add_argument("--engine-timeout", type=float, default=90.0, help="seconds per engine prefill row")
    ap.add_argument("--engine-row", help=argparse.SUPPRESS)  # one engine prefill row, in this process
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.engine_row:
        engine_row(args)
        return
    global DEV, DTYPE
    n_total, H, D = 8192, 32, 128
    if args.dry_run:
        DEV, DTYPE = "cpu", torch.float32
        n_total, H, D, args.chunk, args.reps, args.no_engine = 128, 2, 16, 32, 1, True
    from sgnb.kernels import extend_attention as ext

    saved = (ext.EXTEND_LONG_MIN, ext.EXTEND_LONG_TILES, ext.EXTEND_REVERSE)
    g = torch.Generator().manual_seed(0)
    shapes = {f"1x{n_total} in {n_total // args.chunk} chunks": [case(1, args.chunk, p, H, D, g)
                                                                for p in range(0, n_total, args.chunk)],
              f"1x{n_total} one pass": [case(1, n_total, 0, H, D, g)],
              f"8x{n_total // 8}": [case(8, n_total // 8, 0, H, D, g)]}
    rows = []
    for name, parts in shapes.items():
        flops = sum(f for _, f in parts)
        want = [run(a, CANDIDATES[0]).clone() for a, _ in parts]
        for cfg in CANDIDATES:
            try:
                got = [run(a, cfg) for a, _ in parts]
                err = max(float((x.float() - y.float()).abs().max()) for x, y in zip(got, want))
                ms = time_ms(lambda parts=parts, cfg=cfg: [run(a, cfg) for a, _ in parts], args.reps)
                row = {"shape": name, "tiles": list(cfg[:4]), "reversed": cfg[4], "ms": round(ms, 3),
                       "tflops": round(flops / ms / 1e9, 1), "max_abs_diff": round(err, 4)}
            except Exception as e:  # a tile that does not fit (shared memory) or does not compile
                row = {"shape": name, "tiles": list(cfg[:4]), "reversed": cfg[4], "error": f"{type(e).__name__}: {e}"[:200]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    ext.EXTEND_LONG_MIN, ext.EXTEND_LONG_TILES, ext.EXTEND_REVERSE = saved
    result: dict = {"kernel": rows}
    chunked = [r for r in rows if r["shape"].endswith("chunks") and "ms" in r and r["max_abs_diff"] < 0.05]
    best = min(chunked, key=lambda r: r["ms"]) if chunked else None
    result["best_chunked"] = best
    if best is not None and not args.no_engine:
        engine_rows = {}
        now = list(saved[1]) if saved[1] else None
        variants = {"before": ([64, 64, 4, 3], False, None), "now": (now, saved[2], None),
                    "best": (best["tiles"], best["reversed"], None),
                    "now, 8k chunks": (now, saved[2], {"chunked_prefill_size": 8192})}
        for label, (tiles, rev, engine_args) in variants.items():
            spec = json.dumps({"tiles": tiles, "reverse": rev, "engine_args": engine_args})
            cmd = [sys.executable, __file__, "--model", args.model, "--engine-row", spec] + (
                ["--tokenizer", args.tokenizer] if args.tokenizer else [])
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.engine_timeout)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            engine_rows[label] = json.loads(lines[-1]) if lines else {
                "error": f"rc {proc.returncode}: " + " | ".join(proc.stderr.strip().splitlines()[-3:])[:300]}
            print(label, json.dumps(engine_rows[label]), flush=True)
        result["engine_prefill"] = engine_rows
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
