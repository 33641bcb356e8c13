"""The decode step of the peers on the Llama-2-7B shape (bf16, random weights, context ~1k), greedy, beside
sgnb's in the same run (benchmarks/bench_attention.py --engine gives sgnb's rows):

- gpt-fast: pytorch-labs/gpt-fast's `model.py` (its public repository, kept out of this tree: pass its folder),
  the decode step compiled with mode="reduce-overhead", fullgraph and generate.py's inductor settings (coordinate
  descent tuning), as its generate.py does; greedy argmax.
- gpt-fast-int8: the same with gpt-fast's weight-only int8 linears (its quantize.py, per-channel scales), the
  quantized peer of our FP8 rows.
- gpt-fast-moe: gpt-fast's Mixtral model (`mixtral-moe/model.py` in the same folder) on the Mixtral-8x7B shape,
  --moe-layers of its 32 layers, compiled the same way; batch 1 only (its MoE block's output adds to the residual
  as intended only then). bench_moe_fp8.py's mixtral part runs it beside the engine.
- HF transformers: `generate` with greedy decoding, per-token time = (time(n + k tokens) - time(n)) / k.

    python3 benchmarks/bench_decode_peers.py --gpt-fast-dir .gpu/gpt-fast --batches 1,8,64,128 --out x.json
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch


def _load(folder: str, name: str, as_name: str):
    spec = importlib.util.spec_from_file_location(as_name, Path(folder) / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[as_name] = mod
    spec.loader.exec_module(mod)
    return mod


def _int8(folder: str, model_mod, model):
    """gpt-fast's weight-only int8 (its quantize.py: per-channel int8 weights, bf16 scales) of `model`'s
    random bf16 weights, as its `quantize.py --mode int8` checkpoint would hold them."""
    import types

    saved = {k: sys.modules.get(k) for k in ("model", "tokenizer")}
    sys.modules["model"] = model_mod  # quantize.py imports `from model import Transformer`
    sys.modules["tokenizer"] = types.SimpleNamespace(get_tokenizer=None)  # and a tokenizer it does not use here
    try:
        quantize = _load(folder, "quantize", "gpt_fast_quantize")
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    handler = quantize.WeightOnlyInt8QuantHandler(model)
    state = handler.create_quantized_state_dict()
    model = handler.convert_for_runtime()
    model.load_state_dict(state, assign=True)
    return model.to("cuda")


GPT_FAST_SYSTEMS = {"bf16": "gpt-fast", "int8": "gpt-fast-int8", "moe": "gpt-fast-moe"}  # its models -> row names
PREFILL_CHUNK_MOE = 8  # tokens per prefill call of gpt-fast's Mixtral (8 x 2 experts: 1.9 GB per gathered weight)
MIXTRAL = "Mixtral-8x7B-v0.1"  # gpt-fast's mixtral-moe/model.py config name


def gpt_fast_rows(folder: str, batches: list[int], context: int, steps: int, quant: str = "bf16",
                  layers: int | None = None) -> list[dict]:
    """gpt-fast's decode step at each batch. quant "bf16": its Llama model on the Llama-2-7B shape; "int8": the
    same with its weight-only int8 linears (the quantized peer); "moe": its Mixtral model (mixtral-moe/model.py:
    the routed experts' weights gathered per token, top 2 of 8) on the Mixtral-8x7B shape, `layers` of its 32
    layers (the whole model's 93 GB do not fit an 80 GB card)."""
    if quant == "moe":
        mod = _load(str(Path(folder) / "mixtral-moe"), "model", "gpt_fast_moe_model")
        margs = mod.ModelArgs(**{**mod.transformer_configs[MIXTRAL], **({"n_layer": layers} if layers else {})})
    else:
        mod = _load(folder, "model", "gpt_fast_model")
        margs = mod.ModelArgs.from_name("7B")
    with torch.device("cuda"):
        model = mod.Transformer(margs)
    model = model.to(torch.bfloat16).eval()
    for p in model.parameters():  # small random weights: finite activations through 32 layers
        p.data.normal_(0.0, 0.02)
    if quant == "int8":
        model = _int8(folder, mod, model)

    def step(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        logits = model(x, pos)
        return logits[:, -1].argmax(-1, keepdim=True).to(torch.int32)

    import torch._inductor.config as inductor

    # the compiler settings gpt-fast's generate.py makes before it compiles (its int8 linears' fused dequantizing
    # GEMVs come from the tuning); the rows before 2026-12-07 session 27 were measured without them
    inductor.coordinate_descent_tuning = True
    inductor.triton.unique_kernel_names = True
    inductor.fx_graph_cache = True
    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    rows = []
    for b in batches:
        t0 = time.perf_counter()
        with torch.device("cuda"):
            model.setup_caches(max_batch_size=b, max_seq_length=context + steps + 16)
        with torch.inference_mode():
            x = torch.randint(0, 32000, (b, context), device="cuda", dtype=torch.int32)
            # prefill (eager, as gpt-fast's default). Its Mixtral gathers the routed experts' weights per token,
            # (tokens, 2, 14336, 4096) bf16: 224 GiB for a 1,024-token prompt in one call (2026-12-07 session 30's
            # OOM), so that model prefills in chunks of PREFILL_CHUNK_MOE tokens
            chunk = PREFILL_CHUNK_MOE if quant == "moe" else context
            for start in range(0, context, chunk):
                end = min(context, start + chunk)
                model(x[:, start:end], torch.arange(start, end, device="cuda"))
            cur = torch.zeros(b, 1, dtype=torch.int32, device="cuda")
            pos = torch.tensor([context], device="cuda")
            for _ in range(3):  # compile + graph capture for this shape
                torch.compiler.cudagraph_mark_step_begin()
                cur = compiled(cur, pos).clone()  # a graph's output is overwritten by its next replay
            compile_s = time.perf_counter() - t0
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            for k in range(steps):
                pos.fill_(context + 1 + k)
                torch.compiler.cudagraph_mark_step_begin()
                cur = compiled(cur, pos).clone()
            torch.cuda.synchronize()
            ms = (time.perf_counter() - t1) / steps * 1e3
        rows.append({"system": GPT_FAST_SYSTEMS[quant], "batch": b, "context": context, "decode_step_ms": round(ms, 2),
                     "compile_and_capture_s": round(compile_s, 1), "layers": margs.n_layer})
        print(json.dumps(rows[-1]), flush=True)
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def _generate_s(model, x: torch.Tensor, n: int, kw: dict) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model.generate(x, max_new_tokens=n, min_new_tokens=n, **kw)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def hf_rows(batches: list[int], context: int, steps: int) -> list[dict]:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    rows = []
    for b in batches:
        x = torch.randint(0, 32000, (b, context), device="cuda")
        kw = {"do_sample": False, "pad_token_id": 0, "eos_token_id": None}
        with torch.inference_mode():
            model.generate(x, max_new_tokens=2, min_new_tokens=2, **kw)  # warm up

            short, long = _generate_s(model, x, 2, kw), _generate_s(model, x, 2 + steps, kw)
        rows.append({"system": "hf-transformers", "batch": b, "context": context,
                     "decode_step_ms": round((long - short) / steps * 1e3, 2)})
        print(json.dumps(rows[-1]), flush=True)
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpt-fast-dir", default=None)
    ap.add_argument("--batches", default="1,8,64,128")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--systems", default="gpt-fast,hf-transformers", help="of gpt-fast, gpt-fast-int8 (its "
                    "weight-only int8), gpt-fast-moe (its Mixtral model), hf-transformers")
    ap.add_argument("--moe-layers", type=int, default=None, help="gpt-fast-moe: this many of Mixtral's 32 layers")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    rows: list[dict] = []
    systems = args.systems.split(",")
    for quant, system in GPT_FAST_SYSTEMS.items():
        if system in systems and args.gpt_fast_dir:
            rows += gpt_fast_rows(args.gpt_fast_dir, batches, args.context, args.steps, quant, args.moe_layers)
    if "hf-transformers" in systems:
        rows += hf_rows(batches, args.context, args.steps)
    Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                          "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
