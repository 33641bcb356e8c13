"""`make bench-gpu`: the GPU numbers of issue 12 in one run, one JSON (benchmarks/results/<date>-gpu.json).

- "decode": rows {"batch", "context", "sgnb_ms", "floor_ms", "gpt_fast_ms", "hf_ms"}: the engine's whole decode
  round (bench_attention.engine_cases, CUDA graphs on) beside gpt-fast (compiled, reduce-overhead, greedy; needs
  its model.py: --gpt-fast-dir or $GPT_FAST_DIR, a checkout of pytorch-labs/gpt-fast kept out of this tree) and HF
  transformers' generate, all on the Llama-2-7B shape with random bf16 weights, context 1k. Both engines read
  the same keys a step ("kv_len": gpt-fast's whole 1,072-key cache; our prompts are shortened so that our timed
  steps average 1,072 keys); floor_ms is (weights + those keys' K/V) / the copy rate.
- "prefill": {"tokens_per_s", "ceiling_tokens_per_s", ...}: 8 x 1k and 1 x 8k fresh tokens through the engine,
  against the measured bf16 matmul rate / (2 x parameters).
- "workloads": the suite at GPU scale (bench_suite.py --scale gpu), radix cache on and off and the ablations.
Each part is written as soon as it is done, so a run cut short keeps what it measured.

    python3 benchmarks/bench_gpu.py [--parts decode,prefill,suite] [--gpt-fast-dir DIR] [--tokenizer DIR]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import RESULTS, commit, device_copy_rate, device_name, matmul_peak_gflops, model_params  # noqa: E402

PEER_STEPS = 32  # decode steps the peers time
SUITE_SYSTEMS = ("sgnb,sgnb-no-radix,sgnb-fcfs,sgnb-no-hints,sgnb-no-jump-forward,sgnb-no-cuda-graph,sgnb-no-overlap,"
                 "hf-transformers")


def decode_rows(args: argparse.Namespace, errors: dict) -> list[dict]:
    import bench_attention

    batches = [int(b) for b in args.batches.split(",")]
    # The same keys per step on both sides: gpt-fast's SDPA reads its whole cache every step (context + 32
    # steps + 16 = 1,072 keys, masked), so our prompts are cut to make our timed steps' mean key count 1,072
    # (prompt + 8 untimed tokens + half the timed steps). Without this our 128 timed steps read ~24 more keys a
    # step than gpt-fast's, +0.4 ms of KV at batch 128.
    peer_kv = 1024 + PEER_STEPS + 16
    ns = argparse.Namespace(model=args.model, tokenizer=args.tokenizer, context=peer_kv - 8 - args.steps // 2,
                            steps=args.steps, graphs="on", bandwidth=args.bandwidth)
    ours = {r["batch"]: r for r in bench_attention.engine_cases("auto", batches, ns) if "batch" in r}
    gc.collect()
    peers: dict[str, dict[int, float]] = {"gpt-fast": {}, "hf-transformers": {}}
    import bench_decode_peers as peers_mod

    folder = args.gpt_fast_dir or os.environ.get("GPT_FAST_DIR")
    runs = ([("gpt-fast", lambda: peers_mod.gpt_fast_rows(folder, batches, 1024, PEER_STEPS))] if folder else []) + (
        [("hf-transformers", lambda: peers_mod.hf_rows(batches, 1024, PEER_STEPS))] if args.hf else [])
    for name, run in runs:  # one peer failing keeps the other's rows and ours
        try:
            for r in run():
                peers[name][r["batch"]] = r["decode_step_ms"]
        except Exception as e:
            errors[name] = f"{type(e).__name__}: {e}"[:300]
        gc.collect()
    return [{"batch": b, "context": 1024, "kv_len": peer_kv, "sgnb_ms": ours.get(b, {}).get("decode_step_ms"),
             "floor_ms": ours.get(b, {}).get("floor_ms"), "gpt_fast_ms": peers["gpt-fast"].get(b),
             "hf_ms": peers["hf-transformers"].get(b)} for b in batches]


def prefill_row(args: argparse.Namespace, peak_gflops: float) -> dict:
    import torch

    from sgnb.engine import Engine

    t0 = time.perf_counter()
    eng = Engine(args.model, tokenizer_path=args.tokenizer, context_length=8448, max_running_requests=16,
                 **json.loads(args.engine_args or "{}"))
    start_s = time.perf_counter() - t0
    try:
        cfg = eng.source.config
        g = torch.Generator().manual_seed(0)
        out = {}
        for name, shape in (("8x1024", (8, 1024)), ("1x8192", (1, 8192))):
            prompts = [torch.randint(100, cfg.vocab_size, (shape[1],), generator=g).tolist() for _ in range(shape[0])]
            eng.generate(input_ids=[p[: shape[1] // 2] for p in prompts], sampling_params={"max_new_tokens": 0})
            eng.flush_cache()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": 0})
            # a request with no new token returns once its prefill is launched (nothing to sample waits on
            # it): the device finishes behind (2026-12-03 call 1 read 1.59x the matmul ceiling without this)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
            eng.flush_cache()
            out[name] = round(shape[0] * shape[1] / wall, 1)
        # first-token latency of one fresh request (time from submit to its first token), warm engine
        ttft = {}
        for n in (128, 1024):
            best = float("inf")
            for _ in range(3):
                prompt = torch.randint(100, cfg.vocab_size, (n,), generator=g).tolist()
                r = eng.generate(input_ids=prompt, sampling_params={"max_new_tokens": 1})
                best = min(best, r["meta_info"]["ttft"])
            ttft[str(n)] = round(best * 1e3, 2)
        eng.flush_cache()
        params = model_params(cfg)
        ceiling = peak_gflops * 1e9 / (2 * params)
        stats = eng.get_stats()
        return {"attention_backend": eng.runner.attention_backend, "engine_start_s": round(start_s, 1),
                "warmup_s": stats.get("warmup_seconds"), "cuda_graph": stats.get("cuda_graph"),
                "memory": stats.get("memory"), "first_token_ms": ttft, "tokens_per_s": out,
                "ceiling_tokens_per_s": round(ceiling, 1),
                "fraction_of_ceiling": {k: round(v / ceiling, 3) for k, v in out.items()},
                "matmul_tflops": round(peak_gflops / 1e3, 1)}
    finally:
        eng.shutdown()
        gc.collect()
        torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="decode,prefill,suite")
    ap.add_argument("--model", default="dummy:llama-2-7b-smolvocab")
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--batches", default="1,8,64,128")
    ap.add_argument("--steps", type=int, default=128, help="decode steps timed (the wall difference of 8 and 8 + "
                    "steps tokens; the prefill's run-to-run spread divides by it: at 32, +-1 ms at batch 64-128)")
    ap.add_argument("--bandwidth", type=float, default=None, help="device copy rate, bytes/s (default: measured here, common.device_copy_rate)")
    ap.add_argument("--gpt-fast-dir", default=None)
    ap.add_argument("--hf", action=argparse.BooleanOptionalAction, default=True, help="HF generate's decode rows")
    ap.add_argument("--systems", default=SUITE_SYSTEMS)
    ap.add_argument("--workloads", default="all")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per suite child")
    ap.add_argument("--engine-args", default=None, help='JSON engine options for the prefill part, e.g. '
                    '{"attention_backend": "triton"}')
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench_gpu.py needs a CUDA device")
    if args.bandwidth is None:
        args.bandwidth = device_copy_rate()
    out_path = Path(args.out) if args.out else RESULTS / f"{time.strftime('%Y-%m-%d')}-gpu.json"
    result: dict = {"benchmark": "gpu", "date": time.strftime("%Y-%m-%d"), "device": device_name(),
                    "commit": commit(), "model": args.model, "bandwidth_bytes_per_s": args.bandwidth}
    parts = args.parts.split(",")

    def save() -> None:
        out_path.write_text(json.dumps(result, indent=1))

    peak = matmul_peak_gflops(device="cuda")
    result["matmul_tflops"] = round(peak / 1e3, 1)
    for part in parts:
        try:
            if part == "decode":
                result["decode"] = decode_rows(args, result.setdefault("peer_errors", {}))
            elif part == "prefill":
                result["prefill"] = prefill_row(args, peak)
            elif part == "suite":
                tmp = out_path.with_suffix(".suite.json")
                cmd = [sys.executable, str(HERE / "bench_suite.py"), "--scale", "gpu", "--systems", args.systems,
                       "--workloads", args.workloads, "--model", args.model, "--timeout", str(args.timeout),
                       "--out", str(tmp)] + (["--tokenizer", args.tokenizer] if args.tokenizer else [])
                subprocess.run(cmd, check=False)
                if tmp.exists():
                    result["workloads"] = json.loads(tmp.read_text()).get("workloads", [])
                    tmp.unlink()
        except Exception as e:  # keep what the other parts measured
            result.setdefault("errors", {})[part] = f"{type(e).__name__}: {e}"[:500]
        save()
        print(json.dumps({k: result[k] for k in ("decode", "prefill") if k in result}, indent=1), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
