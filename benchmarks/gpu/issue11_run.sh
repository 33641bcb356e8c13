#!/usr/bin/env bash
# One device call on the lent H200 (issue 11): install the carried wheels (FlashInfer JIT, xgrammar, sgnb built
# here), run the GPU tests of the kernels and attention backends, the attention benchmark with the engine's decode
# step, then the suite's MMLU with the radix cache on and off. Everything lands under $OUT.
#   device run:  bash benchmarks/gpu/issue11_run.sh     (carry: .whl .gpu)
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site SGNB_TEST_TOKENIZER=$PWD/.gpu/smollm2
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
if [ -f .gpu/flashinfer-cache.tgz ]; then mkdir -p ~/.cache && tar xzf .gpu/flashinfer-cache.tgz -C ~/.cache; fi
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader
t0=$(date +%s)
timeout ${TESTS_S:-200} python3 -P -m pytest -q -p no:cacheprovider tests/engine/test_attention_backends.py ${KERNEL_TESTS:-} \
  > $OUT/tests.log 2>&1; echo "tests rc=$? $(( $(date +%s) - t0 ))s"; tail -15 $OUT/tests.log
t0=$(date +%s)
timeout ${BENCH_S:-170} python3 benchmarks/bench_attention.py --engine --out $OUT/attention.json 2> $OUT/attention.log
echo "bench rc=$? $(( $(date +%s) - t0 ))s"; grep -v '^\s*$' $OUT/attention.log | tail -60 | cut -c1-400
t0=$(date +%s)
timeout ${MMLU_S:-130} python3 benchmarks/bench_suite.py --scale gpu --workloads mmlu --systems sgnb,sgnb-no-radix \
  --model dummy:llama-2-7b-smolvocab --tokenizer .gpu/smollm2 --timeout 60 --out $OUT/mmlu.json > $OUT/mmlu.log 2>&1
echo "mmlu rc=$? $(( $(date +%s) - t0 ))s"; tail -12 $OUT/mmlu.log | cut -c1-300
(cd ~/.cache && tar czf $OUT/flashinfer-cache.tgz flashinfer 2>/dev/null); ls -la $OUT
