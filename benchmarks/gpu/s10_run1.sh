#!/usr/bin/env bash
# Device call 1 of 2026-12-03 (session 10), issue 12's measurements that have no valid row yet, and issue 11's
# radix overhead measured directly:
#  1. where the batch-1 (and 8, 64) captured decode forward's GPU time goes, kernel by kernel (decode_kernels.py);
#  2. prefill 8 x 1k and 1 x 8k fresh on the triton backend (session 8's hybrid run crashed), engine start and
#     first-token latency (bench_gpu --parts prefill);
#  3. the engine's decode step at 1/8/64/128 (matched warm-up; session 8's batch-64 row was invalid);
#  4. serving_trace radix on/off with the tree's own host time per row (radix_host_share).
#   device run:  bash benchmarks/gpu/s10_run1.sh     (carry: .whl .gpu)
set -u
source benchmarks/gpu/setup.sh
nvidia-smi --query-gpu=name,memory.used,utilization.gpu --format=csv,noheader
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s); timeout $limit "$@" > $OUT/$name.log 2>&1;
         echo "== $name rc=$? $(( $(date +%s) - t0 ))s"; }
step kernels ${KERNELS_S:-90} python3 -P benchmarks/gpu/decode_kernels.py --tokenizer .gpu/smollm2 --batches 1,8,64 \
  --out $OUT/kernels.json
grep -v "^\s*$" $OUT/kernels.log | grep -v Warning | tail -90 | cut -c1-260
step prefill ${PREFILL_S:-120} python3 -P benchmarks/bench_gpu.py --parts prefill --tokenizer .gpu/smollm2 \
  --engine-args '{"attention_backend": "triton"}' --out $OUT/prefill.json
python3 -c "import json,os; print(json.dumps(json.load(open(os.environ['OUT']+'/prefill.json')), indent=None)[:1500])"
step decode ${DECODE_S:-100} python3 -P benchmarks/bench_attention.py --no-layers --engine --graphs on --backends triton \
  --model dummy:llama-2-7b-smolvocab --tokenizer .gpu/smollm2 --engine-batches 1,8,64,128 --out $OUT/decode.json
grep '^{' $OUT/decode.log | cut -c1-300
step trace ${TRACE_S:-170} python3 -P benchmarks/bench_suite.py --scale gpu --model dummy:llama-2-7b-smolvocab \
  --tokenizer .gpu/smollm2 --timeout 100 --systems sgnb-no-radix,sgnb --workloads serving_trace --out $OUT/trace.json
python3 -c "
import json,os
for w in json.load(open(os.environ['OUT']+'/trace.json'))['workloads']:
    print(w['system'], w.get('programs_per_s'), w.get('wall_s'), w.get('radix_host_seconds'), w.get('radix_host_share'), w.get('forward_seconds'), w.get('decode_round_seconds'))"
