#!/usr/bin/env bash
# Device call 1 of 2026-12-03 (session 11), issue 12's unmeasured targets:
#  1. jump-forward on both JSON workloads, after bounded repeats of one character are written out as flat
#     alternations (xgrammar's chain of nested rules cost 2-4 ms a mask; the rounds waited on the masks);
#  2. >= 5x HF transformers on the prefix-heavy workloads (mmlu read 4.97x; the others never ran beside HF);
#  3. the captured decode forward kernel by kernel at batch 128 (the one batch size still behind gpt-fast).
#   device run:  bash benchmarks/gpu/s11_run1.sh     (carry: .whl .gpu)
set -u
source benchmarks/gpu/setup.sh
suite=(--scale gpu --model dummy:llama-2-7b-smolvocab --tokenizer .gpu/smollm2)
show='import json,sys
for w in json.load(open(sys.argv[1]))["workloads"]:
    print(w["name"], w["system"], w.get("status"), w.get("runs_programs_per_s") or w.get("programs_per_s"), w.get("sgnb_speedup"), w.get("decode_steps"), w.get("engine_rounds"), w.get("wall_s"), str(w.get("error", ""))[:200])'
step json ${JSON_S:-170} python3 -P benchmarks/bench_suite.py "${suite[@]}" --timeout 70 \
  --systems sgnb,sgnb-no-jump-forward --workloads json_jump_forward,json_regex --out $OUT/json.json
python3 -c "$show" $OUT/json.json
step hf ${HF_S:-300} python3 -P benchmarks/bench_suite.py "${suite[@]}" --timeout 80 --systems sgnb,hf-transformers \
  --workloads mmlu,mmlu_select,hellaswag,react --out $OUT/hf.json
python3 -c "$show" $OUT/hf.json
step kernels ${KERNELS_S:-80} python3 -P benchmarks/gpu/decode_kernels.py --tokenizer .gpu/smollm2 --batches 128 \
  --out $OUT/kernels.json
grep -v "^\s*$" $OUT/kernels.log | grep -v Warning | tail -30 | cut -c1-260
