"""Attention backends side by side on a GPU: one layer's attention, then the whole engine's decode step.

    python3 benchmarks/bench_attention.py [--backends torch,triton,flashinfer] [--quick] [--out FILE]

Part 1, one layer through each backend's own API (init_forward_metadata once, attend timed; the KV pool holds
scattered page-size-1 slots, as the engine's does; decode also inside a CUDA graph through the backend's graph
hooks, `graph_ms`: what the engine's decode graphs run): decode at batch 1/8/64/256 over contexts 1k and 4k, prefill
of 8 x 1k fresh tokens and of 8 x 128 new tokens over 1k cached ones, for Llama-2-7B heads (32 q / 32 kv, d 128)
and Llama-3-8B heads (32 / 8). Floors: decode reads every request's K and V once, bytes / the measured copy
bandwidth (--bandwidth); prefill is bound by its attention FLOPs (causal QK^T and PV) / the measured bf16 matmul
rate (--matmul). Reported as measured / floor. Every backend's output is checked against the torch reference
(max abs error) on the same inputs first.

Part 2, the engine (`--engine`): decode step of `dummy:llama-2-7b` (bf16, random weights) at batch 1/8/64 with
~1k-token prompts, per backend, with the decode CUDA graphs (captured at engine start: the capture time is
reported) and eagerly (`--graphs on,off`), vs its floor (weight bytes + KV bytes read per step / bandwidth).
A step is the scheduler's whole decode round (forward, logits, sampling, bookkeeping). Writes one JSON (stdout,
and --out).
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

HEADS = {"llama-2-7b": (32, 32, 128), "llama-3-8b": (32, 8, 128)}


def _time_ms(fn, iters: int = 50) -> float:
    """Median of CUDA-event timings after warm-up."""
    import torch

    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


class _Layer:
    layer_id = 0

    def __init__(self, scale: float) -> None:
        self.scale = scale


GRAPH_REPEATS = 20  # attend calls per captured graph: per-call time without launch gaps, as in a model's graph


def _graph_attend_ms(be, fb, q, layer, max_kv: int, ref, iters: int) -> tuple[float, float]:
    """A decode batch's attention through the backend's CUDA-graph hooks: GRAPH_REPEATS calls captured in one
    graph, replayed; (ms per call, max |out - ref|)."""
    import torch

    be.init_cuda_graph_state(fb.batch_size, max_kv)
    be.init_capture_metadata(fb)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        be.attend(q, layer, fb)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        outs = [be.attend(q, layer, fb) for _ in range(GRAPH_REPEATS)]
    be.init_replay_metadata(fb)
    graph.replay()
    torch.cuda.synchronize()
    err = (outs[-1].float() - ref).abs().max().item()
    return _time_ms(graph.replay, iters=iters) / GRAPH_REPEATS, err


def layer_case(backends: list[str], heads: tuple[int, int, int], prefix: list[int], extend: list[int],
               args: argparse.Namespace) -> dict:
    """One batch (request i: prefix[i] cached tokens + extend[i] new ones) through each backend."""
    import torch

    from sgnb.engine.attention import make_attention_backend
    from sgnb.engine.forward_batch import BatchSpec, ForwardBatch
    from sgnb.engine.kv_pool import KVCache

    H, Hkv, D = heads
    dev = torch.device("cuda")
    seq = [p + e for p, e in zip(prefix, extend)]
    total = sum(seq)
    g = torch.Generator(device=dev).manual_seed(0)
    cache = KVCache(total + 64, 1, Hkv, D, torch.bfloat16, dev)
    perm = torch.randperm(total, device=dev, generator=g) + 1  # scattered slots, never slot 0
    table = torch.zeros(len(seq), max(seq) + 1, dtype=torch.int64, device=dev)
    used = 0
    for i, n in enumerate(seq):
        table[i, :n] = perm[used: used + n]
        used += n
    for buf in (cache.k_buffers[0], cache.v_buffers[0]):
        buf[1:].normal_(generator=g)
    T = sum(extend)
    q = torch.randn(T, H, D, device=dev, dtype=torch.bfloat16, generator=g)
    k = torch.randn(T, Hkv, D, device=dev, dtype=torch.bfloat16, generator=g)
    v = torch.randn(T, Hkv, D, device=dev, dtype=torch.bfloat16, generator=g)
    locs = torch.cat([table[i, p: p + e] for i, (p, e) in enumerate(zip(prefix, extend))])
    spec = BatchSpec(input_ids=[0] * T, out_cache_loc=locs.cpu().numpy(), req_pool_indices=list(range(len(seq))),
                     prefix_lens=list(prefix), extend_lens=list(extend))
    layer = _Layer(D**-0.5)
    cache.store(0, locs, k, v)

    kv_bytes = 2 * total * Hkv * D * 2  # K and V, bf16, each read once
    flops = sum(4 * H * D * e * (p + (e + 1) / 2) for p, e in zip(prefix, extend))  # causal QK^T + PV
    floor_ms = max(kv_bytes / args.bandwidth, flops / args.matmul) * 1e3
    row: dict = {"heads": f"{H}/{Hkv}x{D}", "batch": len(seq), "prefix": prefix[0], "extend": extend[0],
                 "floor_ms": round(floor_ms, 4), "kv_bytes": kv_bytes, "flops": flops}
    ref = None
    for name in backends:
        try:
            be = make_attention_backend(name, cache, H, Hkv, D, dev)
            fb = ForwardBatch.build(spec, table, dev)
            fb.attn_backend = be
            t0 = time.perf_counter()
            be.init_forward_metadata(fb)
            torch.cuda.synchronize()
            plan_ms = (time.perf_counter() - t0) * 1e3
            out = be.attend(q, layer, fb).float()
            if ref is None:
                ref = out
            err = (out - ref).abs().max().item()
            ms = _time_ms(lambda be=be, fb=fb: be.attend(q, layer, fb), iters=args.iters)
            row[name] = {"ms": round(ms, 4), "x_floor": round(ms / floor_ms, 2), "max_err_vs_first": round(err, 5),
                         "metadata_ms_first": round(plan_ms, 2)}
            if set(extend) == {1} and be.supports_cuda_graph:
                gms, gerr = _graph_attend_ms(be, fb, q, layer, total, ref, args.iters)
                row[name].update(graph_ms=round(gms, 4), graph_x_floor=round(gms / floor_ms, 2),
                                 graph_max_err_vs_first=round(gerr, 5))
        except Exception as e:  # a backend that cannot run here is reported, not fatal
            row[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
    print(json.dumps(row), file=sys.stderr, flush=True)
    return row


def engine_cases(backend: str, batches: list[int], args: argparse.Namespace) -> list[dict]:
    """Decode step of the engine at steady batches: wall time per decode round (forward, sampling,
    bookkeeping), one engine per backend; with its CUDA graphs, then without (the same engine, graphs set aside)."""
    import torch

    from sgnb.engine import Engine

    biggest = max(batches)
    modes = args.graphs.split(",")
    t0 = time.perf_counter()
    eng = Engine(args.model, device="cuda", dtype="bfloat16", attention_backend=backend, tokenizer_path=args.tokenizer,
                 max_total_tokens=biggest * (args.context + args.steps + 64) + 1024,
                 disable_cuda_graph="on" not in modes, **getattr(args, "engine_args", {}))
    init_s = time.perf_counter() - t0
    graphs = eng.runner.graphs
    rows = []
    if graphs is not None:
        rows.append({"backend": eng.runner.attention_backend, "engine_init_s": round(init_s, 1),
                     "cuda_graph_capture_s": round(graphs.capture_seconds, 2), "graph_batch_sizes": len(graphs.sizes)})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    try:
        for mode in modes:
            eng.runner.graphs = graphs if mode == "on" else None
            rows += _engine_batches(eng, batches, mode, args)
    finally:
        eng.shutdown()
        del eng, graphs
        gc.collect()  # the next backend's engine needs this one's weights and KV pool gone
        torch.cuda.empty_cache()
    return rows


def _engine_batches(eng, batches: list[int], mode: str, args: argparse.Namespace) -> list[dict]:
    """Steady decode rounds at each batch size, timed from the scheduler's counters."""
    import torch

    rows = []
    cfg = eng.source.config
    weights = sum(p.numel() * p.element_size() for p in eng.runner.model.parameters())
    sp = {"max_new_tokens": args.steps, "temperature": 0, "ignore_eos": True}
    g = torch.Generator().manual_seed(0)
    eng.generate(input_ids=[[5, 6, 7, 8] * 16] * 2, sampling_params={**sp, "max_new_tokens": 4})  # warm up
    for batch in batches:
        eng.flush_cache()
        prompts = [torch.randint(100, cfg.vocab_size, (args.context,), generator=g).tolist() for _ in range(batch)]
        # wall time of steps more: (time(8 + steps tokens) - time(8 tokens)) / steps, both from a fresh cache,
        # so the prefill cancels. The scheduler's decode counters undercount with overlap scheduling (the
        # device keeps running while the host is between rounds): at batch 128 they read below the HBM floor.
        # The two lengths alternate (8, 8 + S, 8, 8 + S, 8, 8 + S) with these very prompts; the first pair is
        # untimed (the prefill's chunks then have the shapes the timed runs meet: 2026-12-02 a warm-up of shorter
        # prompts left batch 64's first timed run paying for new shapes, and the difference read 0.68x the floor),
        # the faster of the other two of each length is kept. Measured one length after the other, a process's
        # first engine read batch 1 below the HBM floor (sessions 16 and 30; the suspect: a device still speeding
        # up while the short runs ran). Beside the wall, the device's own time of each run (the engine's
        # CUDA-event spans, device_time.py): its difference is the GPU time of the steps, free of the host's
        # spread; a wall difference below it is a mismeasurement, flagged in the row.
        lengths = (8, 8 + args.steps)
        walls, device = [float("inf")] * 2, [float("inf")] * 2
        short = 0  # runs where some request got fewer tokens than asked (the difference would then undercount)
        for rep in range(3):
            for i, n in enumerate(lengths):
                eng.flush_cache()
                torch.cuda.synchronize()
                d0 = eng.get_stats()["device_seconds"]
                t0 = time.perf_counter()
                outs = eng.generate(input_ids=prompts, sampling_params={**sp, "max_new_tokens": n})
                wall = time.perf_counter() - t0
                short += any(o["meta_info"]["completion_tokens"] != n for o in outs)
                torch.cuda.synchronize()
                if rep:
                    walls[i] = min(walls[i], wall)
                    device[i] = min(device[i], eng.get_stats()["device_seconds"] - d0)
        ms = (walls[1] - walls[0]) / args.steps * 1e3
        device_ms = (device[1] - device[0]) / args.steps * 1e3
        mean_kv = args.context + 8 + (args.steps - 1) / 2  # keys a timed step reads, on average
        kv = batch * mean_kv * 2 * cfg.num_hidden_layers * cfg.kv_size * 2
        floor = (weights + kv) / args.bandwidth * 1e3
        rows.append({"backend": eng.runner.attention_backend, "cuda_graph": mode, "batch": batch,
                     "context": args.context, "mean_kv_len": round(mean_kv, 1), "decode_step_ms": round(ms, 2),
                     "floor_ms": round(floor, 2),
                     "x_floor": round(ms / floor, 2), "tokens_per_s": round(batch / ms * 1e3, 1),
                     "device_step_ms": round(device_ms, 2), "device_x_floor": round(device_ms / floor, 2),
                     "wall_below_device": ms < 0.95 * device_ms, "short_runs": short})
        graphs = eng.runner.graphs
        if graphs is not None:  # the captured forward alone (GPU time); the rest of the step is the host's
            bs = min(s for s in graphs.sizes if s >= batch)
            graphs.static[bs].loc.fill_(graphs.scratch_slot)  # replays of stale inputs write only scratch
            fwd = _time_ms(graphs.graphs[bs].replay, iters=20)
            rows[-1].update(graph_forward_ms=round(fwd, 2), outside_graph_ms=round(ms - fwd, 2))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backends", default="torch,triton,flashinfer")
    ap.add_argument("--bandwidth", type=float, default=None, help="device copy rate, bytes/s (default: measured here, common.device_copy_rate)")
    ap.add_argument("--matmul", type=float, default=None, help="bf16 matmul rate, FLOP/s (default: measured here)")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--quick", action="store_true", help="fewer shapes")
    ap.add_argument("--engine", action="store_true", help="also the engine's decode step (dummy 7B)")
    ap.add_argument("--model", default="dummy:llama-2-7b")
    ap.add_argument("--tokenizer", default=None, help="tokenizer dir for a dummy model (tokenizer_path)")
    ap.add_argument("--layers", action=argparse.BooleanOptionalAction, default=True, help="part 1")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--engine-batches", default="1,8,64")
    ap.add_argument("--graphs", default="on,off", help="engine decode with CUDA graphs (on), eagerly (off), or both")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch
    from common import commit, device_copy_rate, matmul_peak_gflops

    if args.bandwidth is None:
        args.bandwidth = device_copy_rate()
    if args.matmul is None:
        args.matmul = matmul_peak_gflops(device="cuda") * 1e9
    backends = args.backends.split(",")
    rows = []
    contexts = (1024,) if args.quick else (1024, 4096)
    for heads_name, heads in HEADS.items() if args.layers else ():
        for ctx in contexts:
            for b in (1, 8, 64, 256):
                r = layer_case(backends, heads, [ctx - 1] * b, [1] * b, args)
                rows.append({"kind": "decode", "model_heads": heads_name, **r})
        r = layer_case(backends, heads, [0] * 8, [1024] * 8, args)
        rows.append({"kind": "prefill_fresh", "model_heads": heads_name, **r})
        r = layer_case(backends, heads, [1024] * 8, [128] * 8, args)
        rows.append({"kind": "prefill_over_cached", "model_heads": heads_name, **r})
    engine_rows = []
    if args.engine:
        for backend in backends:
            try:
                engine_rows += engine_cases(backend, [int(x) for x in args.engine_batches.split(",")], args)
            except Exception as e:
                engine_rows.append({"backend": backend, "error": f"{type(e).__name__}: {e}"[:300]})
    result = {"benchmark": "attention", "date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(0),
              "commit": commit(), "torch": torch.__version__, "bandwidth": args.bandwidth, "matmul": args.matmul,
              "layer": rows, "engine_decode": engine_rows}
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
