#!/usr/bin/env bash
# Device call 4 of 2026-12-02 (session 6): radix cache on vs off at GPU scale on the workloads no GPU run had
# reached, on the triton backend (no FlashInfer JIT builds: call 2 lost every child to them, see NOTES.md), with one
# engine start before the suite so Triton's compiles land on disk outside every child's timeout.
#   device run:  bash benchmarks/gpu/s6_run4.sh     (carry: .whl .gpu)
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
mkdir -p ~/.triton && tar xzf .gpu/triton-cache.tgz -C ~/.triton 2>/dev/null
t0=$(date +%s)
timeout 150 python3 -P -c "
import logging; logging.basicConfig(level=logging.INFO)
from sgnb.engine import Engine
Engine('dummy:llama-2-7b-smolvocab', tokenizer_path='.gpu/smollm2', attention_backend='triton').shutdown()" 2>&1 | grep -E "warm-up|backend" | cut -c1-200
echo "prewarm $(( $(date +%s) - t0 ))s"
t0=$(date +%s)
timeout ${SUITE_S:-330} python3 -P benchmarks/bench_suite.py --scale gpu --systems sgnb,sgnb-no-radix \
  --workloads ${WORKLOADS:-json_jump_forward,llm_judge,skeleton_of_thought,chat_long,serving_trace} \
  --engine-args '{"attention_backend": "triton"}' --model dummy:llama-2-7b-smolvocab --tokenizer .gpu/smollm2 \
  --timeout ${CHILD_S:-90} --out $OUT/suite.json > $OUT/suite.log 2>&1
echo "suite rc=$? $(( $(date +%s) - t0 ))s"
python3 benchmarks/gpu/suite_summary.py $OUT/suite.json
