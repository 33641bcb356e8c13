#!/usr/bin/env bash
# Device call 2 of 2026-12-01 (session 2): backend + graph tests on GPU (fp32 oracle), the graphs' forward time
# vs the whole decode step, MMLU at GPU scale with the radix cache on and off, LLaVA-1.5-7B-shaped questions.
#   device run:  bash benchmarks/gpu/issue12_run2.sh     (carry: .whl .gpu)
set -u
source benchmarks/gpu/setup.sh
t0=$(date +%s)
timeout ${TESTS_S:-120} python3 -P -m pytest -q -p no:cacheprovider tests/engine/test_attention_backends.py > $OUT/tests.log 2>&1
echo "tests rc=$? $(( $(date +%s) - t0 ))s"; grep -E "^(FAILED|ERROR|E   )|[0-9]+ (passed|failed)" $OUT/tests.log | head -30
t0=$(date +%s)
timeout ${ENGINE_S:-120} python3 benchmarks/bench_attention.py --no-layers --engine --backends triton,flashinfer \
  --graphs on --steps 32 --tokenizer .gpu/smollm2 --out $OUT/engine.json 2> $OUT/engine.log
echo "engine rc=$? $(( $(date +%s) - t0 ))s"; grep '^{' $OUT/engine.log | cut -c1-300
t0=$(date +%s)
timeout ${MMLU_S:-200} python3 benchmarks/bench_suite.py --scale gpu --workloads mmlu --systems sgnb,sgnb-no-radix \
  --model dummy:llama-2-7b-smolvocab --tokenizer .gpu/smollm2 --timeout 95 --out $OUT/mmlu.json > $OUT/mmlu.log 2>&1
echo "mmlu rc=$? $(( $(date +%s) - t0 ))s"; grep -E "programs/s|timeout|failed|Error" $OUT/mmlu.log | head | cut -c1-300
t0=$(date +%s)
timeout ${LLAVA_S:-170} python3 benchmarks/bench_llava.py --model dummy:llava-1.5-7b --device cuda --tokenizer .gpu/smollm2 \
  --quantization auto --out $OUT/llava.json > $OUT/llava.log 2>&1
echo "llava rc=$? $(( $(date +%s) - t0 ))s"; grep -E "questions_per_s|sgnb_vs_hf|radix_on|Error|error" $OUT/llava.log | head -12 | cut -c1-300
ls -la $OUT
