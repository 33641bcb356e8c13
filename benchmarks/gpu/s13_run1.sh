#!/usr/bin/env bash
# Device call 1 planned in session 13 (2026-12-03; that session had 163 s of device budget, less than a start: NOT
# run yet). In order of what it decides:
#  1. in-batch sharing on the device: a burst of 259 prompts with many copies, sharing on vs off, on triton and
#     (FlashInfer's JIT permitting) hybrid: same greedy tokens, first logprobs within bf16 tolerance, tokens computed;
#  2. json_jump_forward cold and warm with sgnb, sgnb-no-batch-sharing, sgnb-no-jump-forward: the hit rate (session
#     12: 0.68 cold / 0.905 warm vs the optimum 0.95, because copies of a ~25-token prompt were computed side by
#     side) and programs/s, with phase_seconds (the host changes of session 12 were never measured on a GPU);
#  3. json_regex warm, jump-forward on/off (session 12: 1.28x);
#  4. tree_of_thought with the child watchdog (session 12's unexplained > 90 s stall).
#   device run:  bash benchmarks/gpu/s13_run1.sh     (carry: .whl .gpu)
set -u
source benchmarks/gpu/setup.sh
suite=(--scale gpu --model dummy:llama-2-7b-smolvocab --tokenizer .gpu/smollm2)
show='import json,sys
for w in json.load(open(sys.argv[1]))["workloads"]:
    print(w["name"], w["system"], w.get("status"), w.get("programs_per_s"), w.get("sgnb_speedup"), w.get("cache_hit_rate"), w.get("optimal_cache_hit_rate"), w.get("wall_s"), w.get("engine_rounds"), w.get("phase_seconds"))'
step sharing ${SHARE_S:-120} python3 -P benchmarks/gpu/check_batch_sharing.py --tokenizer .gpu/smollm2 \
  --backends ${SHARE_BACKENDS:-triton} --out $OUT/sharing.json
grep '^{' $OUT/sharing.log
step cold ${COLD_S:-120} python3 -P benchmarks/bench_suite.py "${suite[@]}" --timeout 60 \
  --systems sgnb,sgnb-no-batch-sharing,sgnb-no-jump-forward --workloads json_jump_forward --out $OUT/cold.json
python3 -c "$show" $OUT/cold.json
step warm ${WARM_S:-240} python3 -P benchmarks/bench_suite.py "${suite[@]}" --timeout 100 --warm \
  --systems sgnb,sgnb-no-batch-sharing,sgnb-no-jump-forward --workloads json_jump_forward,json_regex --out $OUT/warm.json
python3 -c "$show" $OUT/warm.json
step tot ${TOT_S:-60} python3 -P benchmarks/bench_suite.py "${suite[@]}" --timeout 50 --systems sgnb \
  --workloads tree_of_thought --out $OUT/tot.json
python3 -c "$show" $OUT/tot.json
ls $OUT/*timeout.txt 2>/dev/null && head -c 4000 $OUT/*timeout.txt
