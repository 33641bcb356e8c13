#!/usr/bin/env bash
# Device call 1 of 2026-12-02 (session 6): GPU correctness after sessions 4-5 (overlap scheduling and sampling on
# the device never ran on a GPU), FlashInfer's JIT modules built once for this machine (the later calls reuse them
# while it stays warm), then make bench-gpu's decode rows: the engine (auto = FlashInfer prefill + Triton decode,
# CUDA graphs, overlap) beside gpt-fast (compiled, reduce-overhead) and HF generate, batch 1/8/64/128, context 1k.
#   device run:  bash benchmarks/gpu/s6_run1.sh     (carry: .whl .gpu)
set -u
source benchmarks/gpu/setup.sh
bring_caches() { (cd ~/.cache && tar czf $OUT/flashinfer-cache.tgz flashinfer 2>/dev/null); (cd ~/.triton && tar czf $OUT/triton-cache.tgz cache 2>/dev/null); }
nvidia-smi --query-gpu=name,memory.used,utilization.gpu --format=csv,noheader
t0=$(date +%s)
timeout ${TESTS_S:-300} python3 -P -m pytest -q -p no:cacheprovider tests/engine/test_attention_backends.py > $OUT/tests.log 2>&1
echo "backend tests rc=$? $(( $(date +%s) - t0 ))s"; grep -E "^(FAILED|ERROR|E   )|[0-9]+ (passed|failed)" $OUT/tests.log | head -16
bring_caches
t0=$(date +%s)
timeout ${DECODE_S:-240} python3 -P benchmarks/bench_gpu.py --parts decode --gpt-fast-dir .gpu/gpt-fast \
  --tokenizer .gpu/smollm2 --out $OUT/gpu.json > $OUT/decode.log 2>&1
echo "decode rc=$? $(( $(date +%s) - t0 ))s"
grep -E '^\{"(backend|system)' $OUT/decode.log | cut -c1-260 | head -30
python3 -c "import json,os; d=json.load(open(os.environ['OUT']+'/gpu.json')); [print(r) for r in d.get('decode',[])]; print(d.get('errors'))"
ls -la $OUT
