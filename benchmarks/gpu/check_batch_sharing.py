"""In-batch sharing on a device: a burst of prompts with many copies (json_jump_forward's 200 character prompts,
plus numbered prompts whose tokens repeat after different ones) run with sharing on and off, on each attention
backend given. Checks the same greedy tokens (bf16 near-ties excepted: the top-2 margin below `--tie`) and
first-token logprobs within `--tol`; reports prompt tokens computed, the hit rate and the wall time of each.

    python benchmarks/gpu/check_batch_sharing.py [--model dummy:llama-2-7b-smolvocab] [--backends triton,hybrid]
        [--tokenizer DIR] [--out FILE]

On the CPU: --model dummy:tiny --backends torch (a dry run of the script).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE))
from common import use_tokenizer_dir  # noqa: E402


def prompts() -> list[str]:
    from workloads import build

    wl = build("json_jump_forward", "gpu")
    out = [a["name"] + " is a character in Harry Potter. Please fill in the following information about this "
           "character.\n" for a in wl.args]
    base = "The numbered list below has many items, one per line, and this is"
    return out + [f"{base} Item {n}:" for n in range(1, 60)]


def run(model: str, backend: str, sharing: bool, texts: list[str], extra: dict) -> dict:
    from sgnb.engine import Engine

    with Engine(model, attention_backend=backend, disable_in_batch_sharing=not sharing, **extra) as eng:
        sp = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
        eng.generate(texts[:2], sp)  # first use of this batch's kernels outside the timing
        eng.flush_cache()
        s0 = eng.get_stats()
        t0 = time.perf_counter()
        outs = eng.generate(texts, sp, return_logprob=True, top_logprobs_num=2)
        wall = time.perf_counter() - t0
        s1 = eng.get_stats()
    del eng
    _free_device_memory()  # the next engine sizes its KV pool from what is free
    d = {k: s1[k] - s0[k] for k in ("prompt_tokens", "cached_tokens", "prefill_tokens", "prefill_batches",
                                     "requests_failed")}
    return {"backend": backend, "sharing": sharing, "wall_s": round(wall, 4), **d,
            "hit_rate": round(d["cached_tokens"] / d["prompt_tokens"], 4), "outs": outs}


def _free_device_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def compare(a: list[dict], b: list[dict], tol: float, tie: float) -> dict:
    same = ties = 0
    worst = 0.0
    for x, y in zip(a, b):
        lx = x["meta_info"]["output_token_logprobs"]
        ly = y["meta_info"]["output_token_logprobs"]
        worst = max(worst, abs(lx[0][0] - ly[0][0]))
        if x["output_ids"] == y["output_ids"]:
            same += 1
            continue
        i = next(i for i, (p, q) in enumerate(zip(x["output_ids"], y["output_ids"])) if p != q)
        top = x["meta_info"]["output_top_logprobs"][i]
        if abs(top[0][0] - top[1][0]) < tie:
            ties += 1
    return {"same_tokens": same, "near_ties": ties, "differ": len(a) - same - ties,
            "max_first_logprob_diff": round(worst, 5), "ok": len(a) - same - ties == 0 and worst < tol}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="dummy:llama-2-7b-smolvocab")
    ap.add_argument("--backends", default="triton,hybrid")
    ap.add_argument("--tokenizer")
    ap.add_argument("--engine-args", default="{}")
    ap.add_argument("--tol", type=float, default=0.05)  # bf16: the same rows in other batch shapes
    ap.add_argument("--tie", type=float, default=0.05)
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.tokenizer:
        use_tokenizer_dir(args.tokenizer)
    texts = prompts()
    report = []
    for backend in args.backends.split(","):
        on = run(args.model, backend, True, texts, json.loads(args.engine_args))
        off = run(args.model, backend, False, texts, json.loads(args.engine_args))
        row = {"backend": backend, "requests": len(texts), **compare(off.pop("outs"), on.pop("outs"), args.tol,
                                                                     args.tie),
               "on": on, "off": off}
        print(json.dumps(row), flush=True)
        report.append(row)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    if not all(r["ok"] for r in report):
        sys.exit(1)


if __name__ == "__main__":
    main()
