#!/usr/bin/env bash
# Device call 3 of 2026-12-03 (session 11), the session's last ~6 minutes:
#  1. the ablations at GPU scale never run there: fcfs, no frontend hints, no CUDA graphs, no overlap on
#     chat_short (decode-heavy, short programs), and fcfs / no hints on mmlu (prefix-heavy);
#  2. the views' overhead on the GPU (tree view + stats open; target <= 3% of engine throughput);
#  3. mmlu_select beside HF again (call 2: 4.81x; HF's own runs read 24.3 and 28.2 programs/s).
#   device run:  bash benchmarks/gpu/s11_run4.sh     (carry: .whl .whl-w .gpu)
set -u
source benchmarks/gpu/setup.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl-w/*.whl > /dev/null 2>&1
suite=(--scale gpu --model dummy:llama-2-7b-smolvocab --tokenizer .gpu/smollm2 --timeout 40)
show='import json,sys
for w in json.load(open(sys.argv[1]))["workloads"]:
    print(w["name"], w["system"], w.get("status"), w.get("programs_per_s"), w.get("sgnb_speedup"), w.get("wall_s"), w.get("cache_hit_rate"), str(w.get("error", ""))[:160])'
step abl ${ABL_S:-150} python3 -P benchmarks/bench_suite.py "${suite[@]}" \
  --systems sgnb,sgnb-fcfs,sgnb-no-hints,sgnb-no-cuda-graph,sgnb-no-overlap --workloads chat_short --out $OUT/abl.json
python3 -c "$show" $OUT/abl.json
step abl2 ${ABL2_S:-60} python3 -P benchmarks/bench_suite.py "${suite[@]}" --systems sgnb,sgnb-fcfs,sgnb-no-hints \
  --workloads mmlu --out $OUT/abl2.json
python3 -c "$show" $OUT/abl2.json
step views ${VIEWS_S:-100} python3 -P tests/widgets/measure_tree_overhead.py --model dummy:llama-2-7b-smolvocab \
  --tokenizer .gpu/smollm2 --block large --rounds 6 --budget-s 70 --out $OUT/views.json
grep -v Warning $OUT/views.log | tail -14 | cut -c1-220
step hf ${HF_S:-70} python3 -P benchmarks/bench_suite.py "${suite[@]}" --systems sgnb,hf-transformers \
  --workloads mmlu_select --out $OUT/hf.json
python3 -c "$show" $OUT/hf.json
