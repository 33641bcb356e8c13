"""On a GPU: sliding-window and q/k-norm models through every attention backend, with CUDA graphs, against HF.

Tiny random Gemma 3 (two window layers, one global), Mistral (window) and Qwen3 checkpoints are written by
transformers (head_dim 64, which FlashInfer's kernels take), then run by the engine on CUDA with each attention
backend (triton, flashinfer, hybrid; graphs on, the default) and by transformers in fp32 on the CPU: a ragged batch
of prompts longer than the window with greedy decode, then each prompt extended over its cached prefix. Prints and
writes (--out) the max |logprob diff| of every (arch, backend, dtype); tolerance 2e-3 in fp32, 0.3 in bf16 (the
Triton backend in bf16, whose fp32 run agrees to 3e-5, read 0.19 / 0.21 on tiny Gemma 3 on the H200, 2026-12-05:
bf16 rounding through random weights. Whether a wrong window always shows above 0.3 was not measured: the fp32
rows are the sharp check, the bf16 rows catch gross errors).

    python3 -P benchmarks/gpu/check_windows.py --tokenizer .gpu/smollm2 --out $OUT/windows.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import traceback
from pathlib import Path

import torch

VOCAB, WINDOW = 512, 24
TOL = {"float32": 2e-3, "bfloat16": 0.3}


def tiny(arch: str):
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=384, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, max_position_embeddings=1024, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0)
    if arch == "qwen3":
        return tf.Qwen3ForCausalLM, tf.Qwen3Config(num_hidden_layers=2, tie_word_embeddings=False, **common)
    if arch == "gemma3":
        cfg = tf.Gemma3TextConfig(num_hidden_layers=3, sliding_window=WINDOW, query_pre_attn_scalar=64,
                                  layer_types=["sliding_attention", "sliding_attention", "full_attention"], **common)
        return tf.Gemma3ForCausalLM, cfg
    return tf.MistralForCausalLM, tf.MistralConfig(num_hidden_layers=2, sliding_window=WINDOW, **common)


def checkpoint(arch: str, root: Path, tokenizer: Path):
    cls, cfg = tiny(arch)
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.no_grad():  # peaked distributions, so that a wrong window moves logprobs visibly
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(-0.3, 0.3) if arch == "gemma3" else p.uniform_(0.7, 1.3)
            else:
                p.normal_(0.0, 0.2 if "embed" in name else 0.08)
    path = root / arch
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, path / name)
    return path, model


def max_diff(model, ids: list[int], out: dict, start: int = 0) -> float:
    """Max |logprob diff| against HF over the prompt from `start` (the engine's logprob_start_len) and the output."""
    gen = out["output_ids"]
    with torch.no_grad():
        ref = model(torch.tensor([ids + gen])).logits[0].double().log_softmax(-1)
    got = [lp for lp, _, _ in out["meta_info"]["input_token_logprobs"]]
    diffs = [abs(lp - ref[start + k - 1, ids[start + k]].item())
             for k, lp in enumerate(got) if lp is not None and start + k >= 1]
    diffs += [abs(lp - ref[len(ids) - 1 + j, t].item())
              for j, (lp, t, _) in enumerate(out["meta_info"]["output_token_logprobs"])]
    return max(diffs)


def run(arch: str, path: Path, model, backend: str, dtype: str, device: str) -> dict:
    from sgnb.engine import Engine

    eng = Engine(str(path), device=device, dtype=dtype, attention_backend=backend, max_total_tokens=8192,
                 quantization="none")
    try:
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (70, 33, 120, 9)]
        sp = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
        outs = eng.generate(input_ids=prompts, sampling_params=sp, return_logprob=True, logprob_start_len=0)
        first = max(max_diff(model, p, o) for p, o in zip(prompts, outs))
        longer = [p + o["output_ids"] + torch.randint(3, VOCAB, (40,), generator=g).tolist() for p, o in zip(prompts, outs)]
        outs2 = [eng.generate(input_ids=p, sampling_params=sp, return_logprob=True, logprob_start_len=len(p) - 40)
                 for p in longer]  # each over its cached prefix
        cached = [o["meta_info"]["cached_tokens"] for o in outs2]
        second = max(max_diff(model, p, o, len(p) - 40) for p, o in zip(longer, outs2))
        graphs = getattr(eng.runner, "graphs", None)
        return {"arch": arch, "backend": backend, "dtype": dtype, "max_diff_fresh": round(first, 5),
                "max_diff_cached": round(second, 5), "cached_tokens": cached,
                "graph_replays": getattr(graphs, "replays", None),
                "ok": max(first, second) < TOL[dtype]}
    finally:
        eng.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--runs", default="triton:float32,triton:bfloat16,flashinfer:bfloat16,hybrid:bfloat16")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ("gemma3", "mistral", "qwen3"):
            path, model = checkpoint(arch, Path(tmp), Path(args.tokenizer))
            for backend, dtype in (r.split(":") for r in args.runs.split(",")):
                try:
                    row = run(arch, path, model, backend, dtype, args.device)
                except Exception as e:  # noqa: BLE001 - recorded, the other rows go on
                    row = {"arch": arch, "backend": backend, "dtype": dtype, "ok": False,
                           "error": "".join(traceback.format_exception_only(e)).strip()[-600:]}
                print(json.dumps(row), flush=True)
                rows.append(row)
                Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name() if args.device == "cuda" else args.device, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
