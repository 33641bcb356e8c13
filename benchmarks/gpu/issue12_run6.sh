#!/usr/bin/env bash
# Device call 6 of 2026-12-01 (session 2): program workloads at GPU scale, radix on vs off, on the triton backend
# (FlashInfer's prefill JIT build did not fit the remaining device time), and where FlashInfer's JIT puts builds.
set -u
source benchmarks/gpu/setup.sh
t0=$(date +%s)
timeout ${SUITE_S:-150} python3 benchmarks/bench_suite.py --scale gpu --systems sgnb,sgnb-no-radix \
  --workloads tree_of_thought,chat_short,react --engine-args '{"attention_backend": "triton"}' \
  --model dummy:llama-2-7b-smolvocab --tokenizer .gpu/smollm2 --timeout 40 --out $OUT/suite.json > $OUT/suite.log 2>&1
echo "suite rc=$? $(( $(date +%s) - t0 ))s"; grep -E "^==|programs/s|timeout|failed|Error" $OUT/suite.log | cut -c1-300
