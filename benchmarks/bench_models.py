"""Decode ms/step of the newer architectures' real shapes (random bf16 weights) against their HBM floor, with HF
transformers on the same shape in the same run (issue 32).

Default shapes: dummy:qwen3-8b and dummy:gemma-3-12b (engine/models/configs). Per model and batch (1, 8, 64) at
a 1k context: the engine's whole decode round with its CUDA graphs (bench_attention._engine_batches: the wall
difference of 8 and 8 + steps new tokens), its floor = (the weights a step reads + the keys it reads) / the copy
rate, where an untied input embedding counts only its looked-up rows and a sliding-window layer reads at most
its window's keys; then HF transformers' greedy `generate` on a model built from the same config (random
weights), per-token time = (time(2 + steps tokens) - time(2)) / steps. Rows are written as they are measured.

    python3 benchmarks/bench_models.py [--models dummy:qwen3-8b,dummy:gemma-3-12b] [--tokenizer DIR] --out x.json

On the device (one model per call: each takes a few minutes of start-up, graphs and peers):
    bash benchmarks/gpu/run.sh "script models-qwen3 560 benchmarks/bench_models.py --models dummy:qwen3-8b \
        --tokenizer .gpu/smollm2 --out \\$OUT/models-qwen3.json"
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import commit, device_copy_rate, device_name  # noqa: E402


def floor_ms(cfg, weight_bytes: int, batch: int, mean_kv: float, bandwidth: float, dtype_bytes: int = 2) -> float:
    """(weights read + K/V read) / bandwidth for one decode step of `batch` sequences of ~mean_kv keys."""
    keys = sum(min(mean_kv, cfg.window_of(i) or mean_kv) for i in range(cfg.num_hidden_layers))  # over layers
    kv = batch * keys * 2 * cfg.kv_size * dtype_bytes
    return (weight_bytes + kv) / bandwidth * 1e3


def engine_rows(model: str, args: argparse.Namespace) -> list[dict]:
    import bench_attention
    import torch

    from sgnb.engine import Engine

    batches = [int(b) for b in args.batches.split(",")]
    t0 = time.perf_counter()
    eng = Engine(model, device="cuda", dtype="bfloat16", tokenizer_path=args.tokenizer, context_length=4096,
                 max_total_tokens=max(batches) * (args.context + args.steps + 64) + 1024,
                 cuda_graph_max_bs=max(batches), max_running_requests=max(batches))
    start_s = time.perf_counter() - t0
    try:
        cfg = eng.source.config
        embed = eng.runner.model.model.embed_tokens.weight
        weights = sum(p.numel() * p.element_size() for p in eng.runner.model.parameters())
        ns = argparse.Namespace(steps=args.steps, context=args.context, bandwidth=args.bandwidth)
        rows = bench_attention._engine_batches(eng, batches, "on", ns)
        for r in rows:
            read = weights - (0 if cfg.tie_word_embeddings else embed.numel() * embed.element_size()
                              - r["batch"] * cfg.hidden_size * embed.element_size())
            r["floor_ms"] = round(floor_ms(cfg, read, r["batch"], r["mean_kv_len"], args.bandwidth), 3)
            r["x_floor"] = round(r["decode_step_ms"] / r["floor_ms"], 2)
            r["device_x_floor"] = round(r["device_step_ms"] / r["floor_ms"], 2)
            r.update(system="sgnb", model=model, engine_start_s=round(start_s, 1), weight_bytes_read=read)
        return rows
    finally:
        eng.shutdown()
        del eng
        gc.collect()
        torch.cuda.empty_cache()


def hf_rows(model: str, args: argparse.Namespace) -> list[dict]:
    import torch
    import transformers

    from sgnb.engine.model_loader import resolve_model

    cfg = resolve_model(model).config
    hf_cfg = {"qwen3": transformers.Qwen3Config, "gemma3_text": transformers.Gemma3TextConfig,
              "llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig}[cfg.architecture](
        **cfg.to_hf_dict())
    cls = {"qwen3": "Qwen3ForCausalLM", "gemma3_text": "Gemma3ForCausalLM", "llama": "LlamaForCausalLM",
           "mistral": "MistralForCausalLM"}[cfg.architecture]
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16 on the device (a 12B model in fp32 first: 48 GB)
    try:
        with torch.device("cuda"):
            hf = getattr(transformers, cls)(hf_cfg).eval()
    finally:
        torch.set_default_dtype(default)
    rows = []
    kw = {"do_sample": False, "pad_token_id": 0, "eos_token_id": None}

    def timed(x: torch.Tensor, n: int, lm=hf) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        lm.generate(x, max_new_tokens=n, min_new_tokens=n, **kw)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    try:
        for b in [int(b) for b in args.batches.split(",")]:
            x = torch.randint(100, cfg.vocab_size, (b, args.context), device="cuda")
            with torch.inference_mode():
                timed(x, 2)  # warm up
                short, long = timed(x, 2), timed(x, 2 + args.hf_steps)
            rows.append({"system": "hf-transformers", "model": model, "batch": b, "context": args.context,
                         "decode_step_ms": round((long - short) / args.hf_steps * 1e3, 2),
                         "transformers": transformers.__version__})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        del hf, timed
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="dummy:qwen3-8b,dummy:gemma-3-12b")
    ap.add_argument("--tokenizer", default=None, help="dummy models use SmolLM2's tokenizer: its files' folder")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=64, help="engine decode steps timed")
    ap.add_argument("--hf-steps", type=int, default=16, help="HF generate steps timed")
    ap.add_argument("--bandwidth", type=float, default=None, help="device copy rate, bytes/s (default: measured here, common.device_copy_rate)")
    ap.add_argument("--hf", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench_models.py needs a CUDA device")
    if args.bandwidth is None:
        args.bandwidth = device_copy_rate()
    result: dict = {"benchmark": "models", "date": time.strftime("%Y-%m-%d"), "device": device_name(),
                    "commit": commit(), "bandwidth_bytes_per_s": args.bandwidth, "rows": [], "errors": {}}

    def save() -> None:
        Path(args.out).write_text(json.dumps(result, indent=1))

    for model in args.models.split(","):
        for name, run in (("sgnb", engine_rows), ("hf-transformers", hf_rows if args.hf else None)):
            if run is None:
                continue
            try:  # one system failing keeps the other's rows
                result["rows"] += run(model, args)
            except Exception as e:
                result["errors"][f"{model} {name}"] = f"{type(e).__name__}: {e}"[:500]
                print(f"{model} {name}: {result['errors'][f'{model} {name}']}", flush=True)
            save()
    for r in result["rows"]:
        print(json.dumps({k: r.get(k) for k in ("model", "system", "batch", "decode_step_ms", "device_step_ms", "floor_ms",
                                                    "x_floor")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
