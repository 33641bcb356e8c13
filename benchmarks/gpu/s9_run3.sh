#!/usr/bin/env bash
# Device call 3 of 2026-12-03 (session 9), the session's last ~470 s: after the scheduler stopped working out the
# cascade's shared prefix and groups for forwards that replay a CUDA graph (which never read them), radix on/off
# again on the two workloads where the cache saves nothing: json_jump_forward (twice, alternating; calls 1-2 read
# 0.82-1.05x, within its run-to-run spread) and serving_trace (issue 12's radix overhead with no reuse: 0.988x in
# call 2 and in session 6). Then the engine's decode step at batch 1/8/64/128 (triton, graphs, overlap; the
# wall-difference timing with matched warm-up that session 8's batch-64 row lacked). No peers: no device time.
#   device run:  bash benchmarks/gpu/s9_run3.sh     (carry: .whl .gpu)
set -u
source benchmarks/gpu/setup.sh
common=(--scale gpu --model dummy:llama-2-7b-smolvocab --tokenizer .gpu/smollm2 --timeout ${CHILD_S:-100})
t0=$(date +%s)
timeout ${JJF_S:-105} python3 -P benchmarks/bench_suite.py "${common[@]}" --systems sgnb-no-radix,sgnb --repeat 2 \
  --workloads json_jump_forward --out $OUT/jjf.json > $OUT/jjf.log 2>&1
echo "jjf rc=$? $(( $(date +%s) - t0 ))s"
python3 benchmarks/gpu/suite_summary.py $OUT/jjf.json | grep -v "    slow" | cut -c1-300
python3 -c "import json,os; [print(w['system'], w.get('runs_programs_per_s')) for w in json.load(open(os.environ['OUT']+'/jjf.json'))['workloads']]"
t0=$(date +%s)
timeout ${TRACE_S:-160} python3 -P benchmarks/bench_suite.py "${common[@]}" --systems sgnb-no-radix,sgnb \
  --workloads serving_trace --out $OUT/trace.json > $OUT/trace.log 2>&1
echo "trace rc=$? $(( $(date +%s) - t0 ))s"
python3 benchmarks/gpu/suite_summary.py $OUT/trace.json | grep -v "    slow" | cut -c1-400
[ -n "${SKIP_DECODE:-}" ] && exit 0
t0=$(date +%s)
timeout ${DECODE_S:-75} python3 -P benchmarks/bench_attention.py --no-layers --engine --graphs on --backends triton \
  --model dummy:llama-2-7b-smolvocab --tokenizer .gpu/smollm2 --engine-batches 1,8,64,128 --out $OUT/decode.json \
  > $OUT/decode.log 2>&1
echo "decode rc=$? $(( $(date +%s) - t0 ))s"
python3 -c "import json,os; [print(r) for r in json.load(open(os.environ['OUT']+'/decode.json'))['engine_decode']]"
