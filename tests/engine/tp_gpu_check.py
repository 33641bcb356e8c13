"""GPU check of the tensor-parallel worker path (not collected by pytest: run it by hand on a CUDA machine).

    .venv/bin/python tests/engine/tp_gpu_check.py                    # tp_size=1 through a worker vs in-process
    .venv/bin/python tests/engine/tp_gpu_check.py --tp-size 2        # needs 2 GPUs
    .venv/bin/python tests/engine/tp_gpu_check.py --device cpu       # a dry run of this script on CPU
    python3 tests/engine/tp_gpu_check.py --model dummy:DIR/config.json --tokenizer DIR   # random weights

Builds the in-process engine and the worker engine on the same model, compares prompt and greedy decode
logprobs on a few prompts, times one decode step of a batch on both, and prints one JSON object. Exits 1 when
the logprobs differ by more than --tol or the greedy tokens differ.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

PROMPTS = [
    "The radix tree keeps the KV cache of every prompt it has seen, so a later request that shares a prefix "
    "skips recomputing it. Here is a short story about a cat named Mo:",
    "Question: what is the capital of France? Answer:",
    "def fibonacci(n):\n    ",
    "A list of three colours: red,",
]


def compare(base, other, n_decode: int) -> dict:
    """Max |logprob difference| over prompt and greedy-decode positions; whether the greedy tokens agree."""
    sp = {"max_new_tokens": n_decode, "temperature": 0, "ignore_eos": True}
    worst_prompt = worst_decode = 0.0
    same_tokens = True
    for eng in (base, other):
        eng.flush_cache()
    for prompt in PROMPTS:
        a, b = (e.generate(prompt, sp, return_logprob=True, logprob_start_len=0) for e in (base, other))
        same_tokens &= a["output_ids"] == b["output_ids"]
        pa, pb = a["meta_info"]["input_token_logprobs"][1:], b["meta_info"]["input_token_logprobs"][1:]
        worst_prompt = max(worst_prompt, max(abs(x[0] - y[0]) for x, y in zip(pa, pb)))
        da, db = a["meta_info"]["output_token_logprobs"], b["meta_info"]["output_token_logprobs"]
        n = next((i for i, (x, y) in enumerate(zip(da, db)) if x[1] != y[1]), len(da))  # up to a divergence
        if n:
            worst_decode = max(worst_decode, max(abs(x[0] - y[0]) for x, y in zip(da[:n], db[:n])))
    return {"max_abs_diff_prompt": worst_prompt, "max_abs_diff_decode": worst_decode, "same_tokens": same_tokens}


def decode_step_seconds(eng, batch: int, steps: int, repeats: int = 3) -> float:
    """Seconds per decode step of `batch` requests: (time of 1 + steps tokens - time of 1 token) / steps."""
    prompts = [f"{PROMPTS[0]} Chapter {i}." for i in range(batch)]

    def run(n: int) -> float:
        eng.flush_cache()
        t0 = time.perf_counter()
        eng.generate(prompts, {"max_new_tokens": n, "temperature": 0, "ignore_eos": True})
        return time.perf_counter() - t0

    run(steps + 1)  # warm up
    return min((run(steps + 1) - run(1)) / steps for _ in range(repeats))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--kv-tokens", type=int, default=65536, help="KV pool of each engine (both share GPU 0)")
    ap.add_argument("--decode-tokens", type=int, default=16, help="greedy tokens compared per prompt")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=64, help="decode steps timed")
    ap.add_argument("--tol", type=float, default=None, help="default: 1e-4 for float32, 5e-2 otherwise")
    ap.add_argument("--tokenizer", default=None,
                    help="an HF-format tokenizer directory (a dummy model on a machine without the default model)")
    args = ap.parse_args()

    import torch

    from sgnb.engine import Engine

    if args.tokenizer:  # only the kernel process tokenizes: the workers need no tokenizer
        import sgnb.engine.engine as engine_module
        from sgnb.engine.tokenizer import Tokenizer

        engine_module.load_tokenizer = lambda source, cache_dir=None: Tokenizer.from_dir(args.tokenizer)

    opts = {"device": args.device, "dtype": args.dtype, "max_total_tokens": args.kv_tokens}
    t0 = time.perf_counter()
    base = Engine(args.model, **opts)
    base_load = time.perf_counter() - t0
    t0 = time.perf_counter()
    workers = Engine(args.model, tp_size=args.tp_size, tp_workers=True, **opts)
    workers_load = time.perf_counter() - t0
    try:
        result = compare(base, workers, args.decode_tokens)
        step_base = decode_step_seconds(base, args.batch, args.steps)
        step_workers = decode_step_seconds(workers, args.batch, args.steps)
    finally:
        workers.shutdown()
        base.shutdown()
    tol = args.tol if args.tol is not None else (1e-4 if args.dtype in ("float32", "fp32") else 5e-2)
    ok = result["same_tokens"] and max(result["max_abs_diff_prompt"], result["max_abs_diff_decode"]) <= tol
    report = {
        "check": "tp_gpu_check", "ok": ok, "tol": tol,
        "model": args.model, "dtype": args.dtype, "device": args.device, "tp_size": args.tp_size,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "torch": torch.__version__, "host": platform.node(),
        "load_seconds": {"in_process": round(base_load, 2), "workers": round(workers_load, 2)},
        **result,
        "decode_batch": args.batch,
        "decode_step_ms": {"in_process": round(step_base * 1e3, 3), "workers": round(step_workers * 1e3, 3)},
        "worker_overhead_ms": round((step_workers - step_base) * 1e3, 3),
        "placement": workers.runner.placement,
    }
    print(json.dumps(report, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":  # required: the workers are spawned and import this module again
    sys.exit(main())
