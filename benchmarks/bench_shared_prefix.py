"""64 requests sharing a ~1,000-token few-shot prefix, short suffixes, 1-16 output tokens (issue 2's benchmark).

Systems, same prompts and output lengths, one run: sgnb (radix cache on), sgnb with the radix cache off, and
HF transformers batched `generate` on the same weights. Reports throughput, cache hit rate vs the optimum, and
the compute floor (FLOPs of the tokens that must be computed / measured GEMM peak). Writes JSON to results/.

    python benchmarks/bench_shared_prefix.py [--requests 64] [--skip-hf]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import device_name, matmul_peak_gflops, model_params, optimal_hit_rate, write_result  # noqa: E402

SUBJECTS = ["river", "mountain", "lantern", "violin", "glacier", "orchard", "comet", "harbor", "meadow", "falcon",
            "copper", "library", "canyon", "tulip", "engine", "island", "pepper", "thunder", "marble", "compass"]


def make_workload(tokenizer, n_requests: int, seed: int = 0, prefix_tokens: int = 1000):
    rng = random.Random(seed)
    shots = []
    while True:
        a, b = rng.sample(SUBJECTS, 2)
        shots.append(f"Q: Which is heavier, a {a} or a {b}? Explain briefly.\nA: A {a} is usually heavier than "
                     f"a {b} because of what it is made of.\n")
        text = "Answer like the examples.\n" + "".join(shots)
        if len(tokenizer.encode(text)) >= prefix_tokens:
            break
    prefix = text
    prompts = [prefix + f"Q: Which is heavier, a {rng.choice(SUBJECTS)} or request {i}?\nA:" for i in range(n_requests)]
    out_lens = [rng.randint(1, 16) for _ in range(n_requests)]
    return prompts, out_lens


def run_sgnb(prompts, out_lens, **engine_kwargs) -> dict:
    from sgnb.engine import Engine

    with Engine("smollm2", **engine_kwargs) as eng:
        eng.generate("warm up", {"max_new_tokens": 2})
        eng.flush_cache()
        before = eng.get_stats()
        params = [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for n in out_lens]
        t0 = time.perf_counter()
        outs = eng.generate(prompts, params)
        wall = time.perf_counter() - t0
        after = eng.get_stats()
    prompt_tokens = sum(o["meta_info"]["prompt_tokens"] for o in outs)
    cached = sum(o["meta_info"]["cached_tokens"] for o in outs)
    gen = sum(o["meta_info"]["completion_tokens"] for o in outs)
    lat = sorted(o["meta_info"]["e2e_latency"] for o in outs)
    return {"wall_s": wall, "programs_per_s": len(prompts) / wall, "tokens_per_s": (prompt_tokens + gen) / wall,
            "generated_tokens": gen, "prompt_tokens": prompt_tokens, "cache_hit_rate": cached / prompt_tokens,
            "prefill_tokens_computed": after["prefill_tokens"] - before["prefill_tokens"],
            "decode_steps": after["decode_steps"] - before["decode_steps"],
            "latency_p50_s": lat[len(lat) // 2], "latency_p99_s": lat[min(len(lat) - 1, int(len(lat) * 0.99))],
            "outputs": [o["output_ids"] for o in outs]}


def run_hf(source, prompts, out_lens, batch_size: int = 8) -> dict:
    """transformers' batched generate (left padding, SDPA attention), fp32, greedy, same output lengths."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from sgnb.engine.model_loader import load_state_dict

    cfg = LlamaConfig(**source.config.to_hf_dict())
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg).eval()
    model.load_state_dict(load_state_dict(source, torch.device("cpu"), torch.float32), strict=False)
    model.tie_weights()
    tok = PreTrainedTokenizerFast(tokenizer_file=str(source.path / "tokenizer.json"))
    tok.pad_token_id, tok.padding_side = 2, "left"
    order = sorted(range(len(prompts)), key=lambda i: out_lens[i])  # similar output lengths batch together
    gen_tokens, outputs = 0, {}
    t0 = time.perf_counter()
    with torch.inference_mode():
        for s in range(0, len(order), batch_size):
            idx = order[s: s + batch_size]
            enc = tok([prompts[i] for i in idx], return_tensors="pt", padding=True, add_special_tokens=False)
            n = max(out_lens[i] for i in idx)
            out = model.generate(**enc, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=2)
            for row, i in enumerate(idx):
                outputs[i] = out[row, enc["input_ids"].shape[1]: enc["input_ids"].shape[1] + out_lens[i]].tolist()
                gen_tokens += out_lens[i]
    wall = time.perf_counter() - t0
    prompt_tokens = sum(len(tok(p, add_special_tokens=False)["input_ids"]) for p in prompts)
    return {"wall_s": wall, "programs_per_s": len(prompts) / wall, "tokens_per_s": (prompt_tokens + gen_tokens) / wall,
            "generated_tokens": gen_tokens, "prompt_tokens": prompt_tokens, "cache_hit_rate": 0.0,
            "outputs": [outputs[i] for i in range(len(prompts))], "batch_size": batch_size}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()

    from sgnb.engine.model_loader import load_tokenizer, resolve_model

    source = resolve_model("smollm2")
    tokenizer = load_tokenizer(source)
    prompts, out_lens = make_workload(tokenizer, args.requests)
    ids = [tokenizer.encode(p) for p in prompts]
    optimum = optimal_hit_rate(ids)
    peak = matmul_peak_gflops()
    params = model_params(source.config)
    print(f"{len(prompts)} requests, prompt {min(map(len, ids))}-{max(map(len, ids))} tokens, outputs "
          f"{min(out_lens)}-{max(out_lens)}, optimal hit rate {optimum:.4f}; fp32 GEMM peak {peak:.0f} GFLOP/s")

    systems = {"sgnb": run_sgnb(prompts, out_lens), "sgnb-no-radix": run_sgnb(prompts, out_lens,
                                                                               disable_radix_cache=True)}
    if not args.skip_hf:
        systems["hf-transformers"] = run_hf(source, prompts, out_lens)

    must_compute = (1 - optimum) * sum(map(len, ids)) + sum(out_lens)
    floor_s = must_compute * 2 * params / (peak * 1e9)
    rows = []
    base = systems["sgnb"]
    for name, r in systems.items():
        same = sum(a == b for a, b in zip(r["outputs"], base["outputs"]))
        rows.append({"name": "shared_prefix_64", "system": name, "programs_per_s": r["programs_per_s"],
                     "tokens_per_s": r["tokens_per_s"], "wall_s": r["wall_s"], "cache_hit_rate": r["cache_hit_rate"],
                     "optimal_cache_hit_rate": optimum, "latency_p50_s": r.get("latency_p50_s"),
                     "latency_p99_s": r.get("latency_p99_s"), "decode_steps": r.get("decode_steps"),
                     "prefill_tokens_computed": r.get("prefill_tokens_computed"),
                     "outputs_equal_to_sgnb": f"{same}/{len(prompts)}"})
    ratios = {f"sgnb/{n}": base["programs_per_s"] / r["programs_per_s"] for n, r in systems.items() if n != "sgnb"}
    ratios["hit_rate/optimal"] = base["cache_hit_rate"] / optimum
    ratios["floor_s/sgnb_wall_s"] = floor_s / base["wall_s"]
    print(f"\n{'system':<18}{'wall s':>9}{'programs/s':>12}{'tokens/s':>10}{'hit rate':>10}{'same out':>10}")
    for row in rows:
        print(f"{row['system']:<18}{row['wall_s']:>9.2f}{row['programs_per_s']:>12.2f}{row['tokens_per_s']:>10.0f}"
              f"{row['cache_hit_rate']:>10.3f}{row['outputs_equal_to_sgnb']:>10}")
    print(f"\ncompute floor (must-compute tokens x 2 x {params / 1e6:.0f}M params / peak): {floor_s:.2f} s")
    for k, v in ratios.items():
        print(f"{k:<24}{v:8.2f}")
    targets = {"hit_rate/optimal >= 0.96": ratios["hit_rate/optimal"] >= 0.96,
               "sgnb/sgnb-no-radix >= 4": ratios["sgnb/sgnb-no-radix"] >= 4}
    if "sgnb/hf-transformers" in ratios:
        targets["sgnb/hf-transformers >= 5"] = ratios["sgnb/hf-transformers"] >= 5
    print("targets:", targets)
    path = write_result("cpu", "shared-prefix", {
        "device": device_name(), "model": source.name, "benchmark": "shared_prefix",
        "physical_limit": {"fp32_gemm_gflops": peak, "compute_floor_s": floor_s, "model_params": params},
        "workloads": rows, "ratios": ratios, "targets": targets})
    print("wrote", path)


if __name__ == "__main__":
    main()
