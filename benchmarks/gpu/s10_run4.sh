#!/usr/bin/env bash
# Device call 4 of 2026-12-03 (session 10), the session's last ~7 minutes:
#  1. mmlu at GPU scale beside HF transformers' batched generate on the same dummy 7B (issue 12's >= 5x HF on
#     the prefix-heavy workloads: never measured at GPU scale);
#  2. serving_trace radix off/on after lpm stopped ranking by cached prefixes under 16 tokens (no reuse: it
#     only reordered arrivals) and with the tree's host cost as thread CPU time.
#   device run:  bash benchmarks/gpu/s10_run4.sh     (carry: .whl .gpu)
set -u
source benchmarks/gpu/setup.sh
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s); timeout $limit "$@" > $OUT/$name.log 2>&1;
         echo "== $name rc=$? $(( $(date +%s) - t0 ))s"; }
suite=(--scale gpu --model dummy:llama-2-7b-smolvocab --tokenizer .gpu/smollm2)
show='import json,sys
for w in json.load(open(sys.argv[1]))["workloads"]:
    print(w["name"], w["system"], w.get("status"), w.get("programs_per_s"), w.get("sgnb_speedup"), w.get("cache_hit_rate"), w.get("radix_host_seconds"), w.get("radix_host_share"), str(w.get("error", ""))[:200])'
step hf ${HF_S:-110} python3 -P benchmarks/bench_suite.py "${suite[@]}" --timeout 80 --systems sgnb,hf-transformers \
  --workloads mmlu --out $OUT/hf.json
python3 -c "$show" $OUT/hf.json
step trace ${TRACE_S:-165} python3 -P benchmarks/bench_suite.py "${suite[@]}" --timeout 100 --systems sgnb-no-radix,sgnb \
  --workloads serving_trace --out $OUT/trace.json
python3 -c "$show" $OUT/trace.json
