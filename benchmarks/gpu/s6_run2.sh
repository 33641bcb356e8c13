#!/usr/bin/env bash
# Device call 2 of 2026-12-02 (session 6): the program workloads no GPU run had reached, radix cache on vs off at
# GPU scale (Llama-2-7B shape, random weights, SmolLM2's vocabulary), default backend (auto), on the machine call 1
# warmed (FlashInfer's modules and Triton's compiles in place; setup.sh re-run is a no-op install).
#   device run:  bash benchmarks/gpu/s6_run2.sh     (carry: .whl .gpu)
set -u
source benchmarks/gpu/setup.sh
t0=$(date +%s)
timeout ${SUITE_S:-540} python3 -P benchmarks/bench_suite.py --scale gpu --systems sgnb,sgnb-no-radix \
  --workloads ${WORKLOADS:-serving_trace,json_jump_forward,chat_long,llm_judge,skeleton_of_thought,json_regex} \
  --model dummy:llama-2-7b-smolvocab --tokenizer .gpu/smollm2 --timeout ${CHILD_S:-75} --out $OUT/suite.json > $OUT/suite.log 2>&1
echo "suite rc=$? $(( $(date +%s) - t0 ))s"
python3 benchmarks/gpu/suite_summary.py $OUT/suite.json
grep -E "timeout|Error|Traceback" $OUT/suite.log | head -8
