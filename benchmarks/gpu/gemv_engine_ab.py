"""The engine's decode step with cuBLAS linears vs our GEMV (EngineConfig.cuda_gemv_max_rows), side by side in one
run: bench_attention's wall-difference timing and the captured forward alone, batch 1-4, context 1k, 7B shape.

    python3 -P benchmarks/gpu/gemv_engine_ab.py --tokenizer DIR [--backend triton] [--out FILE]

As run on 2026-12-02 (results/2026-12-02-gpu-gemv.json). The GEMV made the step slower, and the engine option was
removed afterwards, so this script no longer runs as is: restore `cuda_gemv_max_rows` (git log) to repeat it.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_attention  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--batches", default="1,2,4")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows = []
    for gemv_rows in (0, 4, 0, 4):  # twice each, alternating: drift hits both alike
        ns = argparse.Namespace(model="dummy:llama-2-7b-smolvocab", tokenizer=a.tokenizer, context=1024, steps=32,
                                graphs="on", bandwidth=4.27e12, engine_args={"cuda_gemv_max_rows": gemv_rows})
        for r in bench_attention.engine_cases(a.backend, [int(b) for b in a.batches.split(",")], ns):
            if "batch" in r:
                r["gemv_max_rows"] = gemv_rows
                rows.append(r)
                print(json.dumps(r), flush=True)
        if a.out:
            json.dump({"rows": rows}, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    sys.exit(main())
