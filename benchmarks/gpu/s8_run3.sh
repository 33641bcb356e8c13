#!/usr/bin/env bash
# Device call 3 of 2026-12-02 (session 8): issue 12's ablation table (no radix, fcfs, no hints, no jump-forward,
# no CUDA graphs, no overlap) on json_jump_forward, radix on/off on serving_trace (overhead with no reuse), and the views' overhead on the GPU (RadixTreeView + EngineStats
# attached headless, tests/widgets/measure_tree_overhead.py; anywidget and its deps carried in .whl-views).
#   device run:  bash benchmarks/gpu/s8_run3.sh     (carry: .whl .whl-views .gpu)
set -u
source benchmarks/gpu/setup.sh
t0=$(date +%s)
timeout ${ABL_S:-250} python3 -P benchmarks/bench_suite.py --scale gpu --engine-args '{"attention_backend": "triton"}' \
  --model dummy:llama-2-7b-smolvocab --tokenizer .gpu/smollm2 --timeout ${CHILD_S:-60} \
  --systems sgnb,sgnb-no-radix,sgnb-fcfs,sgnb-no-hints,sgnb-no-jump-forward,sgnb-no-cuda-graph,sgnb-no-overlap \
  --workloads json_jump_forward --out $OUT/ablation.json > $OUT/ablation.log 2>&1
echo "ablation rc=$? $(( $(date +%s) - t0 ))s"
python3 benchmarks/gpu/suite_summary.py $OUT/ablation.json | grep -v "    slow"
t0=$(date +%s)
timeout ${TRACE_S:-160} python3 -P benchmarks/bench_suite.py --scale gpu --engine-args '{"attention_backend": "triton"}' \
  --model dummy:llama-2-7b-smolvocab --tokenizer .gpu/smollm2 --timeout 75 --systems sgnb-no-radix,sgnb \
  --workloads serving_trace --out $OUT/trace.json > $OUT/trace.log 2>&1
echo "trace rc=$? $(( $(date +%s) - t0 ))s"
python3 benchmarks/gpu/suite_summary.py $OUT/trace.json
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/views .whl-views/*.whl || exit 1
t0=$(date +%s)
PYTHONPATH=/tmp/site:/tmp/views timeout ${VIEWS_S:-130} python3 -P tests/widgets/measure_tree_overhead.py \
  --model dummy:.gpu/smollm2/config.json --tokenizer .gpu/smollm2 --device cuda --variants none,control,both \
  --block small --block large --budget-s ${VIEWS_BUDGET:-45,45} --out $OUT/views.json > $OUT/views.log 2>&1
echo "views rc=$? $(( $(date +%s) - t0 ))s"; tail -25 $OUT/views.log | cut -c1-220
