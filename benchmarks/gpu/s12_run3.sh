#!/usr/bin/env bash
# Device call 3 of 2026-12-03 (session 12), the last of the budget:
#  1. tree_of_thought, skeleton_of_thought, llm_judge beside HF transformers again, now that a child cut off by its
#     timeout reports how long its timed run had lasted (call 2: HF timed out on all three, with no bound);
#  2. the engine's prefill row with the extend attention's new long-run tiles (reversed 128 x 64 blocks, 4 warps)
#     against the old 64 x 64 ones, each in its own process (call 2's second engine found the first's memory held).
#   device run:  bash benchmarks/gpu/s12_run3.sh     (carry: .whl .gpu)
set -u
source benchmarks/gpu/setup.sh
suite=(--scale gpu --model dummy:llama-2-7b-smolvocab --tokenizer .gpu/smollm2)
show='import json,sys
d = json.load(open(sys.argv[1]))
for w in d["workloads"]:
    print(w["name"], w["system"], w.get("status"), w.get("programs_per_s"), w.get("wall_s"), w.get("timed_s_at_timeout"), w.get("programs_per_s_below"), w.get("sgnb_speedup_above"))
print(d["ratios"], d["targets"])'
for wl_t in skeleton_of_thought:${SOT_T:-55} llm_judge:${JUDGE_T:-60} tree_of_thought:${TOT_T:-100}; do
  wl=${wl_t%%:*}; t=${wl_t#*:}
  step $wl $((2 * t + 25)) python3 -P benchmarks/bench_suite.py "${suite[@]}" --timeout $t --systems sgnb,hf-transformers \
    --workloads $wl --out $OUT/$wl.json
  python3 -c "$show" $OUT/$wl.json
done
step extend ${EXT_S:-170} python3 -P benchmarks/gpu/extend_sweep.py --tokenizer .gpu/smollm2 --out $OUT/extend.json
grep -v Warning $OUT/extend.log | cut -c1-250 | grep -v '"shape": "8x\|one pass' | tail -16
