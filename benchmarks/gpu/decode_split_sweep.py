"""Decode attention's tiles: stage 1 + merge time of kernels/decode_attention.py over a sweep of (BLOCK_N,
num_splits, warps, stages), each timed as 20 calls inside one CUDA graph (no launch overhead, as
in the engine's decode graphs), against the KV-read floor. Llama-2-7B heads (32 x 128, MHA), page-size-1 pool
with scattered slots. Run on a GPU machine:

    python3 benchmarks/gpu/decode_split_sweep.py --batches 64,128 --out $OUT/sweep.json --tiles-out $OUT/tiles.json

--tiles-out: per batch size, the fastest tiles at the engine's split count (default_num_splits), a file for
$SGNB_DECODE_TILES (kernels/decode_attention.DECODE_TILES).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json

import torch

from sgnb.kernels import decode_attention as da


def graph_us(fn, calls: int = 20, reps: int = 5) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / calls)
    return best


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--bandwidth", type=float, default=4.27e12)
    ap.add_argument("--out", default=None)
    ap.add_argument("--tiles-out", default=None, help="write the best tiles at the engine's split count per batch "
                    "size, as $SGNB_DECODE_TILES reads them")
    args = ap.parse_args()
    H = Hkv = 32
    D = 128
    rows: list[dict] = []
    best: dict[int, dict] = {}
    g = torch.Generator(device="cuda").manual_seed(0)
    for B in (int(b) for b in args.batches.split(",")):
        ctx = args.context
        slots = B * ctx + 16
        k_buf = torch.randn(slots, Hkv, D, device="cuda", dtype=torch.bfloat16, generator=g)
        v_buf = torch.randn_like(k_buf)
        perm = torch.randperm(slots - 1, device="cuda", generator=g)[: B * ctx] + 1  # scattered slots
        req_to_token = perm.view(B, ctx).to(torch.int32)
        pool_idx = torch.arange(B, device="cuda")
        kv_end = torch.full((B,), ctx, device="cuda", dtype=torch.int64)
        q = torch.randn(B, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
        out = torch.empty_like(q)
        ref = da.decode_attention_ref(q, k_buf, v_buf, req_to_token, pool_idx, 0, kv_end, D ** -0.5)
        floor_us = B * ctx * Hkv * D * 2 * 2 / args.bandwidth * 1e6
        default_splits = da.default_num_splits(B, Hkv)
        # the split counts: every one at batch <= 8 (short programs), else 1, 2 and the engine's
        splits_grid = {1, 2, 4, 8, 16, 32} if B <= 8 else {1, 2}
        grid = itertools.product((32, 64, 128), sorted(splits_grid | {default_splits}), (2, 4, 8), (1, 2, 3, 4))
        for bn, splits, warps, stages in grid:
            if bn * splits > 2 * ctx and splits > 4:
                continue  # splits of no whole tile
            call = functools.partial(da.decode_attention, q, k_buf, v_buf, req_to_token, pool_idx, 0, kv_end,
                                     D ** -0.5, out=out, num_splits=splits, tiles=(bn, warps, stages))
            try:
                call()
                err = (out.float() - ref.float()).abs().max().item()
                us = graph_us(call)
            except Exception as e:  # a config that does not compile or fit: recorded, the sweep goes on
                rows.append({"batch": B, "block_n": bn, "splits": splits, "warps": warps, "stages": stages,
                             "error": f"{type(e).__name__}: {e}"[:200]})
                continue
            rows.append({"batch": B, "context": ctx, "block_n": bn, "splits": splits, "warps": warps,
                         "stages": stages, "us": round(us, 2), "floor_us": round(floor_us, 2),
                         "x_floor": round(us / floor_us, 2), "max_err": round(err, 4),
                         "is_default": (bn, splits, warps, stages) == (*da.decode_tiles(B)[:1], default_splits,
                                                                      *da.decode_tiles(B)[1:])})
        ok = sorted((r for r in rows if r.get("batch") == B and "us" in r and r["max_err"] < 0.05),
                    key=lambda r: r["us"])
        dflt = [r for r in ok if r["is_default"]]
        print(f"batch {B}: floor {floor_us:.2f} us; default {dflt[0]['us'] if dflt else None} us "
              f"(splits {default_splits}); best:")
        for r in ok[:6]:
            print("  ", json.dumps(r))
        # the engine keeps default_num_splits; its tiles at that split count
        mine = [r for r in ok if r["splits"] == default_splits]
        if mine:
            best[B] = {"max_batch": B, "block_n": mine[0]["block_n"], "warps": mine[0]["warps"],
                       "stages": mine[0]["stages"], "us": mine[0]["us"],
                       "default_us": dflt[0]["us"] if dflt else None}
    if args.tiles_out:
        with open(args.tiles_out, "w") as f:
            json.dump([best[b] for b in sorted(best)], f, indent=1)
        print("tiles:", json.dumps([best[b] for b in sorted(best)]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
