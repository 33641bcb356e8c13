#!/usr/bin/env bash
# Device call 4 of 2026-12-01 (session 2): the suite's program workloads at GPU scale, radix cache on vs off
# (Llama-2-7B-shaped dummy with SmolLM2's vocabulary, hybrid attention, CUDA graphs), then the no-CUDA-graph
# ablation where time remains. Partial results survive (the suite writes after every workload).
#   device run:  bash benchmarks/gpu/issue12_run4.sh     (carry: .whl .gpu)
set -u
source benchmarks/gpu/setup.sh
t0=$(date +%s)
timeout ${SUITE_S:-430} python3 benchmarks/bench_suite.py --scale gpu --systems sgnb,sgnb-no-radix \
  --workloads mmlu_select,hellaswag,react,tree_of_thought,skeleton_of_thought,llm_judge,json_jump_forward,chat_short,serving_trace \
  --model dummy:llama-2-7b-smolvocab --tokenizer .gpu/smollm2 --timeout 45 --out $OUT/suite.json > $OUT/suite.log 2>&1
echo "suite rc=$? $(( $(date +%s) - t0 ))s"; grep -E "^==|programs/s|timeout|failed|Error" $OUT/suite.log | cut -c1-200
t0=$(date +%s)
timeout ${ABL_S:-100} python3 benchmarks/bench_suite.py --scale gpu --systems sgnb,sgnb-no-cuda-graph \
  --workloads chat_short,react --model dummy:llama-2-7b-smolvocab --tokenizer .gpu/smollm2 --timeout 40 \
  --out $OUT/graphs.json > $OUT/graphs.log 2>&1
echo "graphs rc=$? $(( $(date +%s) - t0 ))s"; grep -E "^==|programs/s|timeout|failed|Error" $OUT/graphs.log | cut -c1-200
ls -la $OUT
