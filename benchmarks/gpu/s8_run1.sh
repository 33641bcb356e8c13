#!/usr/bin/env bash
# Device call 1 of 2026-12-02 (session 8): one engine start on the default backend (auto = FlashInfer prefill +
# Triton decode), timed: its FlashInfer JIT builds land on this machine's disk outside every later timing; engine
# start and first-token latency after it. Then make bench-gpu's decode rows (engine beside gpt-fast and HF in one
# run, wall-difference timing) and the prefill row.
#   device run:  bash benchmarks/gpu/s8_run1.sh     (carry: .whl .gpu)
set -u
source benchmarks/gpu/setup.sh
nvidia-smi --query-gpu=name,memory.used,utilization.gpu --format=csv,noheader
t0=$(date +%s)
timeout 240 python3 -P - <<'PY' 2>&1 | grep -vE "Warning|warn\(" | tail -12
import logging, time, json
logging.basicConfig(level=logging.INFO, format="%(message)s")
from sgnb.engine import Engine
for attempt in ("first start (JIT builds)", "second start (built)"):
    t0 = time.perf_counter()
    e = Engine("dummy:llama-2-7b-smolvocab", tokenizer_path=".gpu/smollm2")
    start = time.perf_counter() - t0
    ids = list(range(1000, 1100))
    t1 = time.perf_counter()
    e.generate(input_ids=ids, sampling_params={"max_new_tokens": 1, "temperature": 0})
    ttft = time.perf_counter() - t1
    print(json.dumps({"start": attempt, "engine_start_s": round(start, 2), "warmup_s": round(e.warmup_seconds, 2),
                      "first_token_ms_100_tokens": round(ttft * 1e3, 2), "backend": e.get_stats()["attention_backend"]}))
    e.shutdown()
    del e  # (as run: without this the second start found the first engine's memory still held)
PY
echo "starts $(( $(date +%s) - t0 ))s"
t0=$(date +%s)
timeout ${DECODE_S:-330} python3 -P benchmarks/bench_gpu.py --parts decode,prefill --gpt-fast-dir .gpu/gpt-fast \
  --tokenizer .gpu/smollm2 --out $OUT/gpu.json > $OUT/decode.log 2>&1
echo "bench_gpu rc=$? $(( $(date +%s) - t0 ))s"
python3 -c "import json,os; d=json.load(open(os.environ['OUT']+'/gpu.json')); [print(r) for r in d.get('decode',[])]; print(d.get('prefill')); print(d.get('peer_errors'), d.get('errors'))"
tail -5 $OUT/decode.log | cut -c1-300
