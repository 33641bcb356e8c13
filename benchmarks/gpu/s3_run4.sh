#!/usr/bin/env bash
# Device call 4 of 2026-12-01 (session 3): the workloads call 3 lost (every child hit FlashInfer's JIT rebuild,
# killed mid-build), radix on vs off on the triton backend (no FlashInfer build needed), as many as time allows.
#   device run:  bash benchmarks/gpu/s3_run4.sh     (carry: .whl .gpu)
set -u
source benchmarks/gpu/setup.sh
t0=$(date +%s)
timeout ${SUITE_S:-235} python3 benchmarks/bench_suite.py --scale gpu --systems sgnb,sgnb-no-radix \
  --workloads mmlu_select,json_regex,json_jump_forward,serving_trace,chat_long,llm_judge,skeleton_of_thought \
  --engine-args '{"attention_backend": "triton"}' --model dummy:llama-2-7b-smolvocab --tokenizer .gpu/smollm2 \
  --timeout 30 --out $OUT/suite.json > $OUT/suite.log 2>&1
echo "suite rc=$? $(( $(date +%s) - t0 ))s"
python3 - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/suite.json"))
for w in d.get("workloads", []):
    print(w["name"], w["system"], w.get("status"), round(w.get("programs_per_s") or 0, 2), "p50", w.get("latency_p50_s"),
          "p99", w.get("latency_p99_s"), w.get("engine_rounds"), "fwd_s", w.get("forward_seconds"),
          "dec_s", w.get("decode_round_seconds"), "steps", w.get("decode_steps"), "wall", w.get("wall_s"),
          "hit", w.get("cache_hit_rate"))
PY
