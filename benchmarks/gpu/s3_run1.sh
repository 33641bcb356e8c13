#!/usr/bin/env bash
# Device call 1 of 2026-12-01 (session 3): the engine's start-up warm-up on a fresh machine (FlashInfer JIT and
# Triton builds, then both caches brought back), where an eager forward's time goes (probe_host.py), the GPU
# backend tests incl. the long-context graph test, and chat_short with its ablations (radix, cascade, mixed).
#   device run:  bash benchmarks/gpu/s3_run1.sh     (carry: .whl .gpu)
set -u
source benchmarks/gpu/setup.sh
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
bring_caches() { (cd ~/.cache && tar czf $OUT/flashinfer-cache.tgz flashinfer 2>/dev/null); (cd ~/.triton && tar czf $OUT/triton-cache.tgz cache 2>/dev/null); }
t0=$(date +%s)
timeout ${PROBE_S:-300} python3 -P benchmarks/gpu/probe_host.py --tokenizer .gpu/smollm2 --out $OUT/probe.json > $OUT/probe.log 2>&1
echo "probe rc=$? $(( $(date +%s) - t0 ))s"; grep -vE "^ |^-|USDT" $OUT/probe.log | cut -c1-400 | head -60
bring_caches
t0=$(date +%s)
timeout ${TESTS_S:-150} python3 -P -m pytest -q -p no:cacheprovider tests/engine/test_attention_backends.py \
  --durations=6 > $OUT/tests.log 2>&1
echo "tests rc=$? $(( $(date +%s) - t0 ))s"; grep -E "^(FAILED|ERROR|E   )|[0-9]+ (passed|failed)|s (call|setup)" $OUT/tests.log | head -30
bring_caches
t0=$(date +%s)
timeout ${SUITE_S:-200} python3 benchmarks/bench_suite.py --scale gpu --systems sgnb,sgnb-no-radix,sgnb-no-cascade,sgnb-no-mixed \
  --workloads chat_short,tree_of_thought --model dummy:llama-2-7b-smolvocab --tokenizer .gpu/smollm2 --timeout 60 \
  --out $OUT/suite.json > $OUT/suite.log 2>&1
echo "suite rc=$? $(( $(date +%s) - t0 ))s"; grep -E "^==|programs/s|timeout|failed|Error" $OUT/suite.log | cut -c1-300 | head -20
python3 - <<'PY'
import json, os
try:
    d = json.load(open(os.environ["OUT"] + "/suite.json"))
except Exception as e:
    raise SystemExit(f"no suite.json: {e}")
for w in d.get("workloads", []):
    print(w["name"], w["system"], w.get("status"), round(w.get("programs_per_s") or 0, 2), "p50", w.get("latency_p50_s"),
          "p99", w.get("latency_p99_s"), w.get("engine_rounds"), "fwd_s", w.get("forward_seconds"),
          "dec_s", w.get("decode_round_seconds"), "steps", w.get("decode_steps"), "wall", w.get("wall_s"))
PY
bring_caches; ls -la $OUT
