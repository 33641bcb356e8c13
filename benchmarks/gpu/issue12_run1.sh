#!/usr/bin/env bash
# Device call 1 of 2026-12-01 (session 2): the engine's decode step with CUDA graphs vs eager, triton and
# flashinfer (graph capture time included), then the GPU tests of the attention backends and the graphs.
#   device run:  bash benchmarks/gpu/issue12_run1.sh     (carry: .whl .gpu)
set -u
source benchmarks/gpu/setup.sh
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
t0=$(date +%s)
timeout ${ENGINE_S:-330} python3 benchmarks/bench_attention.py --quick --engine --backends triton,flashinfer \
  --steps 32 --tokenizer .gpu/smollm2 --out $OUT/engine.json 2> $OUT/engine.log
echo "engine rc=$? $(( $(date +%s) - t0 ))s"; grep '^{' $OUT/engine.log | cut -c1-300; grep -iE "error|Traceback" $OUT/engine.log | head -5
t0=$(date +%s)
timeout ${TESTS_S:-230} python3 -P -m pytest -q -p no:cacheprovider tests/engine/test_attention_backends.py \
  --durations=12 > $OUT/tests.log 2>&1
echo "tests rc=$? $(( $(date +%s) - t0 ))s"; grep -E "^(FAILED|ERROR|E   )|passed|failed|s (call|setup)" $OUT/tests.log | head -40
(cd ~/.triton && tar czf $OUT/triton-cache.tgz cache 2>/dev/null); ls -la $OUT
