#!/usr/bin/env bash
# Device call 1 of 2026-12-03 (session 9): issue 11's last item, the radix cache on every program workload at GPU
# scale. json_jump_forward ran 0.80x with the cache on (session 6); suspected cause: eager forwards whose index
# views' 16-byte alignment followed the batch's parity, so Triton compiled kernel variants inside the timing
# (engine/forward_batch.py now aligns every view). Each suite row now says which Triton variants compiled while
# it ran (triton_compiles) and its slowest forwards. Triton backend (no FlashInfer in this call's wheels: no JIT
# builds), Llama-2-7B shape with SmolLM2's vocabulary, bf16.
#   device run:  bash benchmarks/gpu/s9_run1.sh     (carry: .whl .gpu)
set -u
source benchmarks/gpu/setup.sh
nvidia-smi --query-gpu=name,memory.used,utilization.gpu --format=csv,noheader
common=(--scale gpu --model dummy:llama-2-7b-smolvocab --tokenizer .gpu/smollm2 --timeout ${CHILD_S:-90})
t0=$(date +%s)
timeout ${JJF_S:-190} python3 -P benchmarks/bench_suite.py "${common[@]}" --systems sgnb,sgnb-no-radix --repeat 2 \
  --workloads json_jump_forward --out $OUT/jjf.json > $OUT/jjf.log 2>&1
echo "jjf rc=$? $(( $(date +%s) - t0 ))s"; grep "pre-warm" $OUT/jjf.log
python3 benchmarks/gpu/suite_summary.py $OUT/jjf.json | cut -c1-600
t0=$(date +%s)
timeout ${REST_S:-330} python3 -P benchmarks/bench_suite.py "${common[@]}" --systems sgnb,sgnb-no-radix \
  --workloads ${WORKLOADS:-mmlu,mmlu_select,hellaswag,skeleton_of_thought,llm_judge,chat_short,tree_of_thought,react,json_regex} \
  --out $OUT/radix.json > $OUT/radix.log 2>&1
echo "radix rc=$? $(( $(date +%s) - t0 ))s"
python3 benchmarks/gpu/suite_summary.py $OUT/radix.json | grep -v "    slow" | cut -c1-420
[ -d ~/.triton/cache ] && tar czf $OUT/triton-cache.tgz -C ~/.triton cache && ls -la $OUT/triton-cache.tgz
