"""Where a captured decode forward's GPU time goes, kernel by kernel: replays one decode CUDA graph under
torch.profiler and sums each kernel's device time per replay, beside the replay's wall time (the gaps between
kernels are the difference). Run on a GPU machine:

    python3 benchmarks/gpu/decode_kernels.py --tokenizer .gpu/smollm2 --batches 1,64 --out $OUT/kernels.json

Each kernel's bytes are not known here; the table says how much of the step each kernel family takes, which is
what decides the next fusion or GEMV.
"""

from __future__ import annotations

import argparse
import collections
import json
import time

import torch


def family(name: str) -> str:
    n = name.lower()
    for key, fam in (("gemv", "gemv"), ("gemm", "gemm"), ("nvjet", "gemm"), ("cutlass", "gemm"), ("sm90", "gemm"),
                     ("splitk", "gemm"), ("decode", "attention"), ("attn", "attention"), ("merge", "attention"),
                     ("rms", "norm"), ("norm", "norm"), ("rope", "rope"), ("rotary", "rope"), ("silu", "activation"),
                     ("act_and_mul", "activation"), ("store", "kv_store"), ("embedding", "embedding"),
                     ("index", "embedding")):
        if key in n:
            return fam
    return "other"


def profile_graph(replay, reps: int) -> tuple[dict[str, float], float]:
    """(kernel name -> (device microseconds, launches) per replay, wall microseconds per replay)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(5):
        replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        replay()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / reps * 1e6
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            replay()
        torch.cuda.synchronize()
    per: collections.Counter = collections.Counter()
    count: collections.Counter = collections.Counter()
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per[ev.name] += getattr(ev, "device_time", None) or ev.cuda_time
            count[ev.name] += 1
    return {k: (v / reps, count[k] / reps) for k, v in per.items()}, wall


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="dummy:llama-2-7b-smolvocab")
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--engine-args", default="{}", help="JSON engine options")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from sgnb.engine import Engine

    batches = [int(b) for b in args.batches.split(",")]
    eng = Engine(args.model, device="cuda", dtype="bfloat16", attention_backend=args.backend,
                 tokenizer_path=args.tokenizer, max_total_tokens=max(batches) * (args.context + 128) + 1024,
                 **json.loads(args.engine_args))
    out = {"model": args.model, "backend": eng.runner.attention_backend, "context": args.context, "batches": []}
    try:
        cfg = eng.source.config
        g = torch.Generator().manual_seed(0)
        graphs = eng.runner.graphs
        for batch in batches:
            eng.flush_cache()
            prompts = [torch.randint(100, cfg.vocab_size, (args.context,), generator=g).tolist() for _ in range(batch)]
            # a real decode fills the graph's static inputs with this batch's seq lens and slots
            eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": 4, "temperature": 0, "ignore_eos": True})
            bs = min(s for s in graphs.sizes if s >= batch)
            graphs.static[bs].loc.fill_(graphs.scratch_slot)  # replays of stale inputs write only scratch
            per, wall = profile_graph(graphs.graphs[bs].replay, args.reps)
            fam = collections.Counter()
            for name, (us, _) in per.items():
                fam[family(name)] += us
            busy = sum(us for us, _ in per.values())
            row = {"batch": batch, "graph_batch": bs, "replay_wall_us": round(wall, 1), "kernel_us": round(busy, 1),
                   "gaps_us": round(wall - busy, 1), "kernels": round(sum(n for _, n in per.values())),
                   "families_us": {k: round(v, 1) for k, v in fam.most_common()},
                   "kernels_us": {k[:120]: [round(us, 1), round(n)] for k, (us, n) in
                                  sorted(per.items(), key=lambda x: -x[1][0])[:40]}}
            out["batches"].append(row)
            print(json.dumps({k: row[k] for k in ("batch", "replay_wall_us", "kernel_us", "gaps_us", "kernels",
                                                  "families_us")}), flush=True)
            for name, (us, n) in list(row["kernels_us"].items())[:25]:
                print(f"   {us:9.1f} us {n:4d}x  {name}", flush=True)
    finally:
        eng.shutdown()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
