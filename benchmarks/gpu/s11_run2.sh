#!/usr/bin/env bash
# Device call 2 of 2026-12-03 (session 11):
#  1. the scheduler thread profiled (cProfile) on json_jump_forward (call 1: 70 ms a jump-forward round against
#     15 ms a plain decode round, with the masks no longer the cost) and mmlu_select (after prompt logprobs are
#     computed for the whole batch at once: call 1 read 4.09x HF, one LM-head call and device sync per choice);
#  2. mmlu_select and react beside HF transformers (react's HF child gets 130 s: a timeout then bounds its
#     programs/s from above).
#   device run:  bash benchmarks/gpu/s11_run2.sh     (carry: .whl .gpu)
set -u
source benchmarks/gpu/setup.sh
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s); timeout $limit "$@" > $OUT/$name.log 2>&1;
         echo "== $name rc=$? $(( $(date +%s) - t0 ))s"; }
for w in json_jump_forward mmlu_select; do
  step prof_$w ${PROF_S:-75} python3 -P benchmarks/gpu/profile_scheduler.py --workload $w --tokenizer .gpu/smollm2 \
    --top 45 --out $OUT/prof_$w.json
  head -c 9000 $OUT/prof_$w.log | grep -v Warning | cut -c1-200 | head -62
done
suite=(--scale gpu --model dummy:llama-2-7b-smolvocab --tokenizer .gpu/smollm2)
show='import json,sys
for w in json.load(open(sys.argv[1]))["workloads"]:
    print(w["name"], w["system"], w.get("status"), w.get("programs_per_s"), w.get("sgnb_speedup"), w.get("wall_s"), w.get("forward_seconds"), w.get("radix_host_share"), str(w.get("error", ""))[:200])'
step hf ${HF_S:-250} python3 -P benchmarks/bench_suite.py "${suite[@]}" --timeout 130 --systems sgnb,hf-transformers \
  --workloads mmlu_select,react --out $OUT/hf.json
python3 -c "$show" $OUT/hf.json
step gemm ${GEMM_S:-150} python3 -P benchmarks/gpu/gemm_tunableop.py --out $OUT/gemm.json
grep '^{' $OUT/gemm.log | cut -c1-260; grep -v '^{' $OUT/gemm.log | tail -5 | cut -c1-300
