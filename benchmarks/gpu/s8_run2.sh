#!/usr/bin/env bash
# Device call 2 of 2026-12-02 (session 8), the session's last budget: why json_jump_forward ran 0.80x with the
# radix cache on the GPU (session 6): the pair twice, in swapped order, each child reporting its eager forwards,
# their seconds and its slowest forwards by shape (a compile inside the timing, or a shape off the CUDA graphs,
# shows there), mmlu beside it. Then our decode GEMV against cuBLAS: the 7B linears alone (gemv_sweep.py) and the
# engine's decode step with each (gemv_engine_ab.py); the prefill row on the triton backend (call 1's FlashInfer
# prefill crashed); engine start and first-token latency. Triton backend throughout: no FlashInfer JIT builds.
#   device run:  bash benchmarks/gpu/s8_run2.sh     (carry: .whl .gpu)
set -u
source benchmarks/gpu/setup.sh
common=(--scale gpu --engine-args '{"attention_backend": "triton"}' --model dummy:llama-2-7b-smolvocab
        --tokenizer .gpu/smollm2 --timeout ${CHILD_S:-80})
t0=$(date +%s)
timeout ${A_S:-170} python3 -P benchmarks/bench_suite.py "${common[@]}" --systems sgnb,sgnb-no-radix \
  --workloads ${A_WORKLOADS:-json_jump_forward,mmlu} --out $OUT/suite_a.json > $OUT/suite_a.log 2>&1
echo "suite a rc=$? $(( $(date +%s) - t0 ))s"; grep "pre-warm" $OUT/suite_a.log
python3 benchmarks/gpu/suite_summary.py $OUT/suite_a.json
t0=$(date +%s)
timeout ${B_S:-80} python3 -P benchmarks/bench_suite.py "${common[@]}" --systems sgnb-no-radix,sgnb \
  --workloads json_jump_forward --out $OUT/suite_b.json > $OUT/suite_b.log 2>&1
echo "suite b rc=$? $(( $(date +%s) - t0 ))s"
python3 benchmarks/gpu/suite_summary.py $OUT/suite_b.json
t0=$(date +%s)
timeout ${GEMV_S:-60} python3 -P benchmarks/gpu/gemv_sweep.py --rows 1,4 --out $OUT/gemv.json > $OUT/gemv.log 2>&1
echo "gemv rc=$? $(( $(date +%s) - t0 ))s"; grep -v "^{" $OUT/gemv.log | tail -3
python3 -c "import json,os; [print(r['shape'], r['M'], 'torch', r['torch_tb_s'], 'default', r['default_tb_s'], r['default_cfg'], 'best', r['best_tb_s'], r['best_cfg'], 'err', r['max_err']) for r in json.load(open(os.environ['OUT']+'/gemv.json'))['rows']]"
t0=$(date +%s)
timeout ${AB_S:-90} python3 -P benchmarks/gpu/gemv_engine_ab.py --tokenizer .gpu/smollm2 --batches 1,4 --out $OUT/gemv_ab.json > $OUT/gemv_ab.log 2>&1
echo "gemv engine a/b rc=$? $(( $(date +%s) - t0 ))s"; grep "^{" $OUT/gemv_ab.log | cut -c1-250; tail -2 $OUT/gemv_ab.log | cut -c1-250
[ -n "${SKIP_PREFILL:-}" ] && exit 0
t0=$(date +%s)
timeout ${ST_S:-50} python3 -P - <<'PY' 2>&1 | grep "^{"
import json, time
from sgnb.engine import Engine
t0 = time.perf_counter()
e = Engine("dummy:llama-2-7b-smolvocab", tokenizer_path=".gpu/smollm2", attention_backend="triton")
start = time.perf_counter() - t0
ttft = []
for i in range(3):
    t1 = time.perf_counter()
    e.generate(input_ids=list(range(1000 + i, 1100 + i)), sampling_params={"max_new_tokens": 1, "temperature": 0})
    ttft.append(time.perf_counter() - t1)
print(json.dumps({"engine_start_s": round(start, 2), "warmup_s": round(e.warmup_seconds, 2),
                  "first_token_ms_100_token_prompt": [round(t * 1e3, 2) for t in ttft]}))
PY
timeout ${PF_S:-60} python3 -P benchmarks/bench_gpu.py --parts prefill --engine-args '{"attention_backend": "triton"}' \
  --tokenizer .gpu/smollm2 --out $OUT/prefill.json > $OUT/prefill.log 2>&1
echo "start+prefill rc=$? $(( $(date +%s) - t0 ))s"
python3 -c "import json,os; d=json.load(open(os.environ['OUT']+'/prefill.json')); print(d.get('prefill'), d.get('errors'))"
