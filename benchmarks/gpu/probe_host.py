"""Where an eager forward's time goes on the GPU: host (launch) time vs device time per forward shape, per kernel
wrapper, and a torch.profiler table of one eager prefill. Run on a GPU machine:

    python3 benchmarks/gpu/probe_host.py --tokenizer .gpu/smollm2 --out $OUT/probe.json

Host time = wall time of the call without synchronizing (the launches); total = with a synchronize after.
A forward whose host time is near its total is launch-bound: the GPU waits on Python.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, reps: int = 10) -> dict:
    fn()
    sync()
    host, total = [], []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        sync()
        t2 = time.perf_counter()
        host.append((t1 - t0) * 1e3)
        total.append((t2 - t0) * 1e3)
    return {"host_ms": round(statistics.median(host), 3), "total_ms": round(statistics.median(total), 3)}


def per_call(fn, n: int = 200) -> float:
    """Host microseconds per call of fn (launch cost; the device runs behind)."""
    fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    sync()
    return round((t1 - t0) / n * 1e6, 1)


def probe_backend(args: argparse.Namespace, backend: str, with_profile: bool) -> dict:
    from sgnb.engine import Engine
    from sgnb.engine.forward_batch import BatchSpec, ForwardBatch

    t0 = time.perf_counter()
    eng = Engine(args.model, tokenizer_path=args.tokenizer, attention_backend=backend, max_running_requests=64,
                 context_length=4096)
    start = {"engine_start_s": round(time.perf_counter() - t0, 2), "warmup_s": round(eng.warmup_seconds, 2),
             "graph_capture_s": eng.runner.graphs.capture_seconds if eng.runner.graphs else None,
             "extend_graph_capture_s": eng.runner.extend_graphs.capture_seconds if eng.runner.extend_graphs else None}
    print(backend, start, flush=True)
    runner = eng.runner
    model, attn, rtt = runner.model, runner.attn, runner.req_pool.req_to_token
    rows = [runner.req_pool.alloc() for _ in range(64)]
    prefix_slots = runner.kv_pool.alloc(1024)
    for r in rows:  # every row: the same 1024-token prefix (a shared radix prefix)
        runner.req_pool.write(r, 0, prefix_slots)

    def spec(batch: int, prefix: int, extend: int, shared: int = 0) -> BatchSpec:
        loc = runner.kv_pool.alloc(batch * extend)
        for i in range(batch):
            runner.req_pool.write(rows[i], prefix, loc[i * extend:(i + 1) * extend])
        runner.req_pool.sync_device()  # the table's device copy, as the runner's forward does
        return BatchSpec(input_ids=[1000 + i for i in range(batch * extend)], out_cache_loc=loc,
                         req_pool_indices=rows[:batch], prefix_lens=[prefix] * batch, extend_lens=[extend] * batch,
                         shared_len=shared)

    def eager(s: BatchSpec):
        def run():
            fb = ForwardBatch.build(s, rtt, runner.device)
            fb.attn_backend = attn
            attn.init_forward_metadata(fb)
            return model(fb)
        return run

    shapes = {}
    with torch.inference_mode():
        for name, s in [("decode b1 ctx1k", spec(1, 1023, 1)), ("decode b8 ctx1k", spec(8, 1023, 1)),
                        ("decode b64 ctx1k", spec(64, 1023, 1)),
                        ("decode b64 ctx1k cascade", spec(64, 1023, 1, shared=1000)),
                        ("prefill 1x16", spec(1, 0, 16)), ("prefill 8x16", spec(8, 0, 16)),
                        ("prefill 1x512", spec(1, 0, 512)), ("prefill 8x1024", spec(8, 0, 1024)),
                        ("extend 8x64 over 960", spec(8, 960, 64)),
                        ("extend 8x64 over 960 cascade", spec(8, 960, 64, shared=960)),
                        ("extend 32x16 over 960 cascade", spec(32, 960, 16, shared=960)),
                        ("extend 32x16 over 960", spec(32, 960, 16))]:
            shapes[name] = timed(eager(s))
            if runner.graphs is not None and s.mode.value == "decode" and not s.shared_len:
                shapes[name + " graph"] = timed(lambda s=s: runner.graphs.replay(s))
            if runner.extend_graphs is not None and runner.extend_graphs.can_run(s):
                shapes[name + " graph"] = timed(lambda s=s: runner.extend_graphs.replay(s))
            print(backend, name, shapes[name], shapes.get(name + " graph"), flush=True)
        h = torch.randn(8, model.config.hidden_size, device=runner.device, dtype=runner.dtype)
        shapes["logits 8 rows"] = timed(lambda: runner.logits(h))

        from sgnb.kernels import apply_rope, fused_add_rms_norm, rms_norm, silu_and_mul, store_kv
        from sgnb.kernels.decode_attention import decode_attention
        from sgnb.kernels.extend_attention import extend_attention

        cfg = model.config
        H, Hkv, D, hid = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
        dev, dt = runner.device, runner.dtype
        x = torch.randn(1, hid, device=dev, dtype=dt)
        res = torch.randn(1, hid, device=dev, dtype=dt)
        w = torch.ones(hid, device=dev, dtype=dt)
        q = torch.randn(1, H, D, device=dev, dtype=dt)
        k = torch.randn(1, Hkv, D, device=dev, dtype=dt)
        pos = torch.tensor([5], device=dev)
        gu = torch.randn(1, 2 * cfg.intermediate_size, device=dev, dtype=dt)
        lin = model.model.layers[0].self_attn.qkv_proj
        kb, vb = runner.kv_cache.k_buffers[0], runner.kv_cache.v_buffers[0]
        loc = torch.tensor([int(prefix_slots[5])], device=dev)
        r1 = torch.tensor(rows[:1], device=dev)
        seq = torch.tensor([1024], device=dev)
        qo = torch.tensor([0, 1], device=dev)
        kernels = {
            "rms_norm": lambda: rms_norm(x, w, 1e-5),
            "fused_add_rms_norm": lambda: fused_add_rms_norm(x, res, w, 1e-5),
            "apply_rope": lambda: apply_rope(q, k, pos, model.rope_cos, model.rope_sin),
            "store_kv": lambda: store_kv(kb, vb, loc, k, k),
            "silu_and_mul": lambda: silu_and_mul(gu),
            "qkv linear (nn.Linear)": lambda: lin(x),
            "decode_attention b1 1k": lambda: decode_attention(q, kb, vb, rtt, r1, 0, seq, D**-0.5,
                                                               num_splits=8),
            "extend_attention 1x1 over 1k": lambda: extend_attention(q, kb, vb, rtt, r1, qo, 0, seq, True,
                                                                    D**-0.5, 1),
            "torch.empty": lambda: torch.empty(1, H, D, device=dev, dtype=dt),
            "torch add": lambda: x + res,
        }
        launch = {name: per_call(fn) for name, fn in kernels.items()}
        print(backend, launch, flush=True)

        prof_table = None
        if with_profile:
            from torch.profiler import ProfilerActivity, profile

            s = spec(8, 0, 16)
            run = eager(s)
            run()
            sync()
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            with profile(activities=acts) as prof:
                run()
                sync()
            prof_table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
            print(prof_table, flush=True)
    eng.shutdown()
    return {"start": start, "forward_shapes": shapes, "host_us_per_call": launch,
            "profile_prefill_8x16_eager": prof_table}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="dummy:llama-2-7b-smolvocab")
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--backends", default="triton,hybrid")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    result: dict = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "torch": torch.__version__, "backends": {}}
    for i, backend in enumerate(args.backends.split(",")):
        result["backends"][backend] = probe_backend(args, backend, with_profile=i == 0)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
