#!/usr/bin/env bash
# Device call 2 of 2026-12-03 (session 10), issue 12:
#  1. decode attention's tiles at batch 1 and 8 (call 1: 9.3 us a layer for stage 1 at batch 1 against a 3.9 us
#     KV-read floor, + 1.9 us of merge);
#  2. the batch-1 captured forward kernel by kernel after RoPE + K/V store became one launch;
#  3. make bench-gpu's decode (steps 128: call 1's batch-64 wall difference over 32 steps carried +-1 ms of the
#     prefill's spread) beside gpt-fast and HF generate, and prefill with a synchronize after it (call 1's
#     8 x 1k read 1.59x the matmul ceiling: a no-token request returns when its prefill is launched).
#   device run:  bash benchmarks/gpu/s10_run2.sh     (carry: .whl .gpu)
set -u
source benchmarks/gpu/setup.sh
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s); timeout $limit "$@" > $OUT/$name.log 2>&1;
         echo "== $name rc=$? $(( $(date +%s) - t0 ))s"; }
step sweep ${SWEEP_S:-100} python3 -P benchmarks/gpu/decode_split_sweep.py --batches 1,8 --out $OUT/split_sweep.json
grep -v Warning $OUT/sweep.log | tail -20 | cut -c1-300
step kernels ${KERNELS_S:-60} python3 -P benchmarks/gpu/decode_kernels.py --tokenizer .gpu/smollm2 --batches 1 \
  --out $OUT/kernels.json
grep -v "^\s*$" $OUT/kernels.log | grep -v Warning | tail -14 | cut -c1-200
step gpu ${GPU_S:-380} python3 -P benchmarks/bench_gpu.py --parts decode,prefill --tokenizer .gpu/smollm2 \
  --gpt-fast-dir .gpu/gpt-fast --engine-args '{"attention_backend": "triton"}' --out $OUT/gpu.json
python3 -c "import json,os; d=json.load(open(os.environ['OUT']+'/gpu.json')); [print(r) for r in d.get('decode', [])]; print(json.dumps({k: d.get(k) for k in ('prefill','errors','peer_errors')})[:1500])"
grep '^{' $OUT/gpu.log | cut -c1-300 | head -12
