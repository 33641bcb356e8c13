#!/usr/bin/env bash
# Device call 3 of 2026-12-03 (session 10):
#  1. decode attention's stage-1 tiles at batch 1/8/64/128 (the engine's split counts), written as a tiles file;
#  2. the engine's decode step (matched to gpt-fast's 1,072 keys a step) with the default tiles at 64/128 and
#     with the swept tiles at 1/8/64/128 (SGNB_DECODE_TILES), one run each;
#  3. issue 11: json_jump_forward radix off/on twice, alternating, and serving_trace off/on, both with the tree's
#     own host time per row (radix_host_share), after the tail-copy fix in the tree walks.
#   device run:  bash benchmarks/gpu/s10_run3.sh     (carry: .whl .gpu)
set -u
source benchmarks/gpu/setup.sh
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s); timeout $limit "$@" > $OUT/$name.log 2>&1;
         echo "== $name rc=$? $(( $(date +%s) - t0 ))s"; }
step sweep ${SWEEP_S:-110} python3 -P benchmarks/gpu/decode_split_sweep.py --batches 1,8,64,128 \
  --out $OUT/sweep.json --tiles-out $OUT/tiles.json
grep -v Warning $OUT/sweep.log | grep -v "^   {" | tail -8 | cut -c1-600
common=(--parts decode --no-hf --tokenizer .gpu/smollm2)
step decode_default ${DFLT_S:-70} python3 -P benchmarks/bench_gpu.py "${common[@]}" --batches 64,128 --out $OUT/decode_default.json
[ -s $OUT/tiles.json ] && step decode_tiles ${TILES_S:-100} env SGNB_DECODE_TILES=$OUT/tiles.json python3 -P \
  benchmarks/bench_gpu.py "${common[@]}" --batches 1,8,64,128 --out $OUT/decode_tiles.json
for f in decode_default decode_tiles; do grep '"cuda_graph": "on"' $OUT/$f.log | sed "s/^/$f /" | cut -c1-330; done
suite=(--scale gpu --model dummy:llama-2-7b-smolvocab --tokenizer .gpu/smollm2 --timeout 100 --systems sgnb-no-radix,sgnb)
show='import json,sys
for w in json.load(open(sys.argv[1]))["workloads"]:
    print(w["name"], w["system"], w.get("runs_programs_per_s") or w.get("programs_per_s"), w.get("radix_host_seconds"), w.get("radix_host_share"), w.get("triton_compiles"))'
step jjf ${JJF_S:-125} python3 -P benchmarks/bench_suite.py "${suite[@]}" --repeat 2 --workloads json_jump_forward --out $OUT/jjf.json
python3 -c "$show" $OUT/jjf.json
step trace ${TRACE_S:-165} python3 -P benchmarks/bench_suite.py "${suite[@]}" --workloads serving_trace --out $OUT/trace.json
python3 -c "$show" $OUT/trace.json
