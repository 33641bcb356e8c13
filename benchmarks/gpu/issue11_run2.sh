#!/usr/bin/env bash
# Second device call of issue 11: the engine's decode step per backend, MMLU radix on/off, the backend tests.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site SGNB_TEST_TOKENIZER=$PWD/.gpu/smollm2
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
mkdir -p ~/.cache && tar xzf .gpu/flashinfer-cache.tgz -C ~/.cache
t0=$(date +%s)
timeout 130 python3 benchmarks/bench_attention.py --no-layers --engine --tokenizer .gpu/smollm2 --out $OUT/engine.json 2> $OUT/engine.log
echo "engine rc=$? $(( $(date +%s) - t0 ))s"; grep '^{' $OUT/engine.log | cut -c1-300
t0=$(date +%s)
timeout 110 python3 benchmarks/bench_suite.py --scale gpu --workloads mmlu --systems sgnb,sgnb-no-radix \
  --model dummy:llama-2-7b-smolvocab --tokenizer .gpu/smollm2 --timeout 50 --out $OUT/mmlu.json > $OUT/mmlu.log 2>&1
echo "mmlu rc=$? $(( $(date +%s) - t0 ))s"; tail -8 $OUT/mmlu.log | cut -c1-300
t0=$(date +%s)
timeout 90 python3 -P -m pytest -q -p no:cacheprovider tests/engine/test_attention_backends.py > $OUT/tests.log 2>&1
echo "tests rc=$? $(( $(date +%s) - t0 ))s"; grep -E "^(FAILED|E   )|passed|failed" $OUT/tests.log | head -30
