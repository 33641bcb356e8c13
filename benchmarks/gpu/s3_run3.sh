#!/usr/bin/env bash
# Device call 3 of 2026-12-01 (session 3): the re-scoped GPU tests, the rest of the program workloads radix on vs
# off, the GIL switch-interval ablation on the decode-heavy workloads, and LLaVA-NeXT-Video at the 7B shape.
#   device run:  bash benchmarks/gpu/s3_run3.sh     (carry: .whl .gpu)
set -u
source benchmarks/gpu/setup.sh
t0=$(date +%s)
timeout ${TESTS_S:-100} python3 -P -m pytest -q -p no:cacheprovider tests/engine/test_attention_backends.py \
  -k "cascade or long_context or extend_graphs" tests/kernels/test_small_kernels_triton.py > $OUT/tests.log 2>&1
echo "tests rc=$? $(( $(date +%s) - t0 ))s"; grep -E "^(FAILED|ERROR|E   )|[0-9]+ (passed|failed)" $OUT/tests.log | head -12
t0=$(date +%s)
timeout ${SUITE_S:-230} python3 benchmarks/bench_suite.py --scale gpu --systems sgnb,sgnb-no-radix \
  --workloads skeleton_of_thought,llm_judge,json_regex,json_jump_forward,chat_long,serving_trace,mmlu_select \
  --model dummy:llama-2-7b-smolvocab --tokenizer .gpu/smollm2 --timeout 40 --out $OUT/suite.json > $OUT/suite.log 2>&1
echo "suite rc=$? $(( $(date +%s) - t0 ))s"
t0=$(date +%s)
timeout ${GIL_S:-120} python3 benchmarks/bench_suite.py --scale gpu --systems sgnb,sgnb-gil-5ms \
  --workloads tree_of_thought,react --model dummy:llama-2-7b-smolvocab --tokenizer .gpu/smollm2 --timeout 50 \
  --out $OUT/gil.json > $OUT/gil.log 2>&1
echo "gil rc=$? $(( $(date +%s) - t0 ))s"
python3 - <<'PY'
import json, os
for name in ("suite", "gil"):
    try:
        d = json.load(open(os.environ["OUT"] + f"/{name}.json"))
    except Exception as e:
        print(f"no {name}.json: {e}"); continue
    for w in d.get("workloads", []):
        print(w["name"], w["system"], w.get("status"), round(w.get("programs_per_s") or 0, 2), "p50", w.get("latency_p50_s"),
              "p99", w.get("latency_p99_s"), w.get("engine_rounds"), "fwd_s", w.get("forward_seconds"),
              "dec_s", w.get("decode_round_seconds"), "steps", w.get("decode_steps"), "wall", w.get("wall_s"))
PY
grep -hE "timeout|Error" $OUT/suite.log $OUT/gil.log | head -6
t0=$(date +%s)
timeout ${LLAVA_S:-90} python3 benchmarks/bench_llava.py --model dummy:llava-next-video-7b --device cuda \
  --tokenizer .gpu/smollm2 --quantization auto --out $OUT/llava_video.json > $OUT/llava_video.log 2>&1
echo "llava video rc=$? $(( $(date +%s) - t0 ))s"; grep -E "per_s|sgnb_vs_hf|radix|frames|Error|error" $OUT/llava_video.log | head -12 | cut -c1-300
ls -la $OUT
