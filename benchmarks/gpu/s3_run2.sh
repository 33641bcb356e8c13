#!/usr/bin/env bash
# Device call 2 of 2026-12-01 (session 3): kernel and backend tests on the GPU (block-table extends, extend CUDA
# graphs, the 1.7k-token extend case), the program workloads at GPU scale with radix on vs off (now with extend
# graphs), and the host-cost probe with the extend graphs' replay times.
#   device run:  bash benchmarks/gpu/s3_run2.sh     (carry: .whl .gpu)
set -u
source benchmarks/gpu/setup.sh
bring_caches() { (cd ~/.cache && tar czf $OUT/flashinfer-cache.tgz flashinfer 2>/dev/null); (cd ~/.triton && tar czf $OUT/triton-cache.tgz cache 2>/dev/null); }
t0=$(date +%s)
timeout ${KTESTS_S:-80} python3 -P -m pytest -q -p no:cacheprovider tests/kernels/test_attention_triton.py tests/kernels/test_small_kernels_triton.py > $OUT/ktests.log 2>&1
echo "kernel tests rc=$? $(( $(date +%s) - t0 ))s"; grep -E "^(FAILED|ERROR|E   )|[0-9]+ (passed|failed)" $OUT/ktests.log | head -12
t0=$(date +%s)
timeout ${TESTS_S:-140} python3 -P -m pytest -q -p no:cacheprovider tests/engine/test_attention_backends.py > $OUT/tests.log 2>&1
echo "backend tests rc=$? $(( $(date +%s) - t0 ))s"; grep -E "^(FAILED|ERROR|E   )|[0-9]+ (passed|failed)" $OUT/tests.log | head -16
bring_caches
t0=$(date +%s)
timeout ${SUITE_S:-260} python3 benchmarks/bench_suite.py --scale gpu --systems sgnb,sgnb-no-radix \
  --workloads chat_short,tree_of_thought,mmlu,react,hellaswag,skeleton_of_thought --model dummy:llama-2-7b-smolvocab \
  --tokenizer .gpu/smollm2 --timeout 50 --out $OUT/suite.json > $OUT/suite.log 2>&1
echo "suite rc=$? $(( $(date +%s) - t0 ))s"
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
grep -E "timeout|Error" $OUT/suite.log | head -5
t0=$(date +%s)
timeout ${PROBE_S:-70} python3 -P benchmarks/gpu/probe_host.py --backends triton --tokenizer .gpu/smollm2 --out $OUT/probe.json > $OUT/probe.log 2>&1
echo "probe rc=$? $(( $(date +%s) - t0 ))s"; grep -vE "^ |^-|USDT|Warning" $OUT/probe.log | cut -c1-300 | head -24
bring_caches; ls -la $OUT
