#!/usr/bin/env bash
# Device call 3 of 2026-12-01 (session 2): backend + graph tests on GPU (incl. hybrid; FlashInfer's cascade JIT
# builds here the first time), the hybrid backend's decode step, MMLU at GPU scale radix on/off (warmed up).
#   device run:  bash benchmarks/gpu/issue12_run3.sh     (carry: .whl .gpu)
set -u
source benchmarks/gpu/setup.sh
t0=$(date +%s)
timeout ${TESTS_S:-300} python3 -P -m pytest -v -p no:cacheprovider tests/engine/test_attention_backends.py \
  --durations=8 > $OUT/tests.log 2>&1
echo "tests rc=$? $(( $(date +%s) - t0 ))s"; grep -E "^(FAILED|ERROR|E   )|[0-9]+ (passed|failed)|s (call|setup)" $OUT/tests.log | head -30
(cd ~/.cache && tar czf $OUT/flashinfer-cache.tgz flashinfer 2>/dev/null)
t0=$(date +%s)
timeout ${ENGINE_S:-60} python3 benchmarks/bench_attention.py --no-layers --engine --backends hybrid \
  --graphs on --steps 32 --tokenizer .gpu/smollm2 --out $OUT/engine.json 2> $OUT/engine.log
echo "engine rc=$? $(( $(date +%s) - t0 ))s"; grep '^{' $OUT/engine.log | cut -c1-300
t0=$(date +%s)
timeout ${MMLU_S:-150} python3 benchmarks/bench_suite.py --scale gpu --workloads mmlu --systems sgnb,sgnb-no-radix \
  --model dummy:llama-2-7b-smolvocab --tokenizer .gpu/smollm2 --timeout 70 --out $OUT/mmlu.json > $OUT/mmlu.log 2>&1
echo "mmlu rc=$? $(( $(date +%s) - t0 ))s"; grep -E "programs/s|timeout|failed|Error" $OUT/mmlu.log | head | cut -c1-300
(cd ~/.triton && tar czf $OUT/triton-cache.tgz cache 2>/dev/null); ls -la $OUT
