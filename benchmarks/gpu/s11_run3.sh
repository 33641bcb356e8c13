#!/usr/bin/env bash
# Device call 2 of 2026-12-03 (session 11; two starts of an earlier script were refused, so this one call carries the
# rest, most needed first):
#  1. jump-forward on both JSON workloads again, after cache_unfinished stopped re-walking the tree (call 1:
#     1.15x / 1.21x with cheap masks: a jump-forward round still took ~70 ms against ~15 ms a decode round);
#  2. the scheduler thread profiled on json_jump_forward (why the round costs that);
#  3. mmlu_select and react beside HF transformers, after prompt logprobs are computed for the whole batch
#     (call 1: mmlu_select 4.09x; react's HF child gets 130 s: a timeout bounds its programs/s from above);
#  4. decode's linears with cuBLAS's default algorithm vs TunableOp's timed pick (batch 1 / 8 / 64 / 128).
#   device run:  bash benchmarks/gpu/s11_run3.sh     (carry: .whl .gpu)
set -u
source benchmarks/gpu/setup.sh
suite=(--scale gpu --model dummy:llama-2-7b-smolvocab --tokenizer .gpu/smollm2)
show='import json,sys
for w in json.load(open(sys.argv[1]))["workloads"]:
    print(w["name"], w["system"], w.get("status"), w.get("programs_per_s"), w.get("sgnb_speedup"), w.get("wall_s"), w.get("decode_steps"), w.get("engine_rounds"), w.get("forward_seconds"), w.get("radix_host_share"), str(w.get("error", ""))[:200])'
step json ${JSON_S:-140} python3 -P benchmarks/bench_suite.py "${suite[@]}" --timeout 60 \
  --systems sgnb,sgnb-no-jump-forward --workloads json_jump_forward,json_regex --out $OUT/json.json
python3 -c "$show" $OUT/json.json
step prof ${PROF_S:-70} python3 -P benchmarks/gpu/profile_scheduler.py --workload json_jump_forward \
  --tokenizer .gpu/smollm2 --top 40 --out $OUT/prof.json
grep -v Warning $OUT/prof.log | cut -c1-180 | head -88
step hf ${HF_S:-230} python3 -P benchmarks/bench_suite.py "${suite[@]}" --timeout 130 --systems sgnb,hf-transformers \
  --workloads mmlu_select,react --out $OUT/hf.json
python3 -c "$show" $OUT/hf.json
step gemm ${GEMM_S:-90} python3 -P benchmarks/gpu/gemm_tunableop.py --out $OUT/gemm.json
grep '^{' $OUT/gemm.log | cut -c1-260; grep -v '^{' $OUT/gemm.log | tail -4 | cut -c1-300
