#!/usr/bin/env bash
# Device call 1 of 2026-12-03 (session 12):
#  1. jump-forward on/off on both JSON workloads, each run WARM (the workload once untimed in its child first:
#     grammar compiles outside the timing) and with the scheduler's phase timers (where a round's host time goes);
#     the block form of written-out bounded repeats runs on the GPU for the first time;
#  2. json_jump_forward cold (the suite's default), the same systems;
#  3. mmlu_select beside HF transformers (session 11: 4.81x, HF's own runs 24.3 / 28.2 programs/s).
#   device run:  bash benchmarks/gpu/s12_run1.sh     (carry: .whl .gpu)
set -u
source benchmarks/gpu/setup.sh
suite=(--scale gpu --model dummy:llama-2-7b-smolvocab --tokenizer .gpu/smollm2)
show='import json,sys
for w in json.load(open(sys.argv[1]))["workloads"]:
    print(w["name"], w["system"], w.get("status"), w.get("programs_per_s"), w.get("sgnb_speedup"), w.get("wall_s"), w.get("decode_steps"), w.get("engine_rounds"), w.get("phase_seconds"))'
step warm ${WARM_S:-260} python3 -P benchmarks/bench_suite.py "${suite[@]}" --timeout 100 --warm \
  --systems sgnb,sgnb-no-jump-forward --workloads json_jump_forward,json_regex --out $OUT/warm.json
python3 -c "$show" $OUT/warm.json
step cold ${COLD_S:-90} python3 -P benchmarks/bench_suite.py "${suite[@]}" --timeout 60 \
  --systems sgnb,sgnb-no-jump-forward --workloads json_jump_forward --out $OUT/cold.json
python3 -c "$show" $OUT/cold.json
step hf ${HF_S:-90} python3 -P benchmarks/bench_suite.py "${suite[@]}" --timeout 60 --systems sgnb,hf-transformers \
  --workloads mmlu_select --out $OUT/hf.json
python3 -c "$show" $OUT/hf.json
