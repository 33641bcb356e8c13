#!/usr/bin/env bash
# Device call 2 of 2026-12-02 (session 8): why json_jump_forward ran 0.80x with the radix cache on the GPU
# (session 6). The pair twice, in swapped order, each child reporting its eager forwards, their seconds and its
# slowest forwards by shape (a compile inside the timing, or a shape off the CUDA graphs, shows there); mmlu and
# serving_trace (issue 12's < 1% radix overhead on a trace with no reuse) beside it. Triton backend: no FlashInfer
# JIT builds on a fresh machine.
#   device run:  bash benchmarks/gpu/s8_run2.sh     (carry: .whl .gpu)
set -u
source benchmarks/gpu/setup.sh
common=(--scale gpu --engine-args '{"attention_backend": "triton"}' --model dummy:llama-2-7b-smolvocab
        --tokenizer .gpu/smollm2 --timeout ${CHILD_S:-100})
t0=$(date +%s)
timeout ${A_S:-260} python3 -P benchmarks/bench_suite.py "${common[@]}" --systems sgnb,sgnb-no-radix \
  --workloads json_jump_forward,mmlu --out $OUT/suite_a.json > $OUT/suite_a.log 2>&1
echo "suite a rc=$? $(( $(date +%s) - t0 ))s"; grep "pre-warm" $OUT/suite_a.log
python3 benchmarks/gpu/suite_summary.py $OUT/suite_a.json
t0=$(date +%s)
timeout ${B_S:-280} python3 -P benchmarks/bench_suite.py "${common[@]}" --systems sgnb-no-radix,sgnb \
  --workloads json_jump_forward,serving_trace --out $OUT/suite_b.json > $OUT/suite_b.log 2>&1
echo "suite b rc=$? $(( $(date +%s) - t0 ))s"
python3 benchmarks/gpu/suite_summary.py $OUT/suite_b.json
