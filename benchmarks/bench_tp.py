"""Tensor parallelism on GPUs: decode step time of a dummy-weight model at tp sizes, against the floor.

    python3 benchmarks/bench_tp.py --model dummy:llama-2-7b --tp 1,2 [--batches 1,8,32] [--tokenizer DIR]

Floor per decode step: the weight bytes each GPU reads (all weights / tp) at the measured copy bandwidth
(--bandwidth, bytes per second; 4.27e12, the H200's measured device copy rate, as in shared/recipes/gpu.md). The all-reduce
time (2 per layer) is part of the measured step, not of this floor. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def step_ms(eng, batch: int, steps: int) -> float:
    prompts = [f"Request {i}: tell me a long story about the sea." for i in range(batch)]

    def run(n: int) -> float:
        eng.flush_cache()
        t0 = time.perf_counter()
        eng.generate(prompts, {"max_new_tokens": n, "temperature": 0, "ignore_eos": True})
        return time.perf_counter() - t0

    run(4)
    return min((run(steps + 1) - run(1)) / steps for _ in range(2)) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="dummy:llama-2-7b")
    ap.add_argument("--tp", default="1,2")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--bandwidth", type=float, default=4.27e12)
    ap.add_argument("--kv-tokens", type=int, default=16384)
    ap.add_argument("--tokenizer", default=None)
    args = ap.parse_args()

    import torch

    from sgnb.engine import Engine
    from sgnb.engine.model_loader import resolve_model

    if args.tokenizer:
        import sgnb.engine.engine as engine_module
        from sgnb.engine.tokenizer import Tokenizer

        engine_module.load_tokenizer = lambda source, cache_dir=None: Tokenizer.from_dir(args.tokenizer)
    cfg = resolve_model(args.model).config
    rows = []
    for tp in (int(x) for x in args.tp.split(",")):
        t0 = time.perf_counter()
        eng = Engine(args.model, device="cuda", dtype=args.dtype, tp_size=tp, tp_workers=True,
                     max_total_tokens=args.kv_tokens)
        load_s = time.perf_counter() - t0
        params = sum(p for p in _param_counts(cfg))
        floor_ms = params * torch.tensor([], dtype=getattr(torch, args.dtype)).element_size() / tp / args.bandwidth * 1e3
        try:
            for b in (int(x) for x in args.batches.split(",")):
                ms = step_ms(eng, b, args.steps)
                rows.append({"tp": tp, "batch": b, "decode_step_ms": round(ms, 2), "floor_ms": round(floor_ms, 2),
                             "floor/measured": round(floor_ms / ms, 3), "tokens_per_s": round(b / ms * 1e3, 1),
                             "load_s": round(load_s, 1)})
                print(rows[-1], file=sys.stderr, flush=True)
        finally:
            eng.shutdown()
    print(json.dumps({"model": args.model, "dtype": args.dtype, "gpus": torch.cuda.device_count(),
                      "gpu": torch.cuda.get_device_name(0), "rows": rows}, indent=1))
    return 0


def _param_counts(cfg):
    attn = cfg.hidden_size * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    attn += cfg.num_attention_heads * cfg.head_dim * cfg.hidden_size
    yield cfg.num_hidden_layers * (attn + 3 * cfg.hidden_size * cfg.intermediate_size)
    yield cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)


if __name__ == "__main__":  # required: tensor-parallel workers are spawned and import this module again
    sys.exit(main())
