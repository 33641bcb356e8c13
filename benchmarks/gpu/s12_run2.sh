#!/usr/bin/env bash
# Device call 2 of 2026-12-03 (session 12):
#  1. tree_of_thought, skeleton_of_thought, llm_judge beside HF transformers (the >= 5x target's last three rows;
#     sgnb ran them in 16.7 / 5.0 / 6.2 s in session 10, so each child's limit is ~5x that plus HF's start: a
#     timeout is a lower bound on the ratio);
#  2. the extend attention's tiles and block order on a long prompt (benchmarks/gpu/extend_sweep.py), then the
#     engine's prefill row with the best candidate (1 x 8k was 59% of the matmul ceiling, target 60%).
#   device run:  bash benchmarks/gpu/s12_run2.sh     (carry: .whl .gpu)
set -u
source benchmarks/gpu/setup.sh
suite=(--scale gpu --model dummy:llama-2-7b-smolvocab --tokenizer .gpu/smollm2)
show='import json,sys
for w in json.load(open(sys.argv[1]))["workloads"]:
    print(w["name"], w["system"], w.get("status"), w.get("programs_per_s"), w.get("sgnb_speedup"), w.get("wall_s"), w.get("cache_hit_rate"), w.get("phase_seconds"))'
for wl_t in tree_of_thought:${TOT_T:-120} skeleton_of_thought:${SOT_T:-55} llm_judge:${JUDGE_T:-65}; do
  wl=${wl_t%%:*}; t=${wl_t#*:}
  step $wl $((2 * t + 20)) python3 -P benchmarks/bench_suite.py "${suite[@]}" --timeout $t --systems sgnb,hf-transformers \
    --workloads $wl --out $OUT/$wl.json
  python3 -c "$show" $OUT/$wl.json
done
step extend ${EXT_S:-170} python3 -P benchmarks/gpu/extend_sweep.py --tokenizer .gpu/smollm2 --out $OUT/extend.json
grep -v Warning $OUT/extend.log | cut -c1-250 | tail -45
