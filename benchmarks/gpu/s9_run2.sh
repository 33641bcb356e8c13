#!/usr/bin/env bash
# Device call 2 of 2026-12-03 (session 9): the rest of issue 11's radix on/off table (react, json_regex, chat_long,
# serving_trace: the last one also issue 12's "radix overhead with no reuse"), json_jump_forward again after the
# warm-up took the plain eager extend at BLOCK_M 16 and 32 (call 1: its first radix child compiled those two
# variants inside its timing: 13.9 programs/s, then 18.2 with them cached), and issue 12's jump-forward ablation
# on both JSON workloads. Triton backend, Llama-2-7B shape with SmolLM2's vocabulary, bf16; call 1's Triton cache.
#   device run:  bash benchmarks/gpu/s9_run2.sh     (carry: .whl .gpu)
set -u
source benchmarks/gpu/setup.sh
nvidia-smi --query-gpu=name,memory.used,utilization.gpu --format=csv,noheader
t0=$(date +%s)
timeout ${SUITE_S:-540} python3 -P benchmarks/bench_suite.py --scale gpu --model dummy:llama-2-7b-smolvocab \
  --tokenizer .gpu/smollm2 --timeout ${CHILD_S:-100} --systems sgnb,sgnb-no-radix,sgnb-no-jump-forward \
  --workloads ${WORKLOADS:-json_jump_forward,react,json_regex,chat_long,serving_trace} --out $OUT/suite.json \
  > $OUT/suite.log 2>&1
echo "suite rc=$? $(( $(date +%s) - t0 ))s"; grep "pre-warm" $OUT/suite.log
python3 benchmarks/gpu/suite_summary.py $OUT/suite.json | grep -v "    slow" | cut -c1-460
