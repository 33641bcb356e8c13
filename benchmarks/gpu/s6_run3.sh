#!/usr/bin/env bash
# Device call 3 of 2026-12-02 (session 6): LLaVA-NeXT-Video-7B shape (random weights) video Q&A, sgnb vs radix off
# vs HF generate per question (PyAV carried in .whl-av); make bench-gpu's prefill row (8 x 1k, 1 x 8k fresh); the
# suite's CUDA ablations (no overlap, no CUDA graphs) and HF transformers on a prefix-heavy workload.
#   device run:  bash benchmarks/gpu/s6_run3.sh     (carry: .whl-av .gpu; .whl's packages stay installed from call 1)
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site SGNB_TEST_TOKENIZER=$PWD/.gpu/smollm2
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-av/*.whl || exit 1
python3 -c "import sgnb, flashinfer, xgrammar, av; print('packages ok', av.__version__)" || exit 1
t0=$(date +%s)
timeout ${LLAVA_S:-200} python3 -P benchmarks/bench_llava.py --model dummy:llava-next-video-7b --images 0 --videos 2 \
  --frames 8 --device cuda --tokenizer .gpu/smollm2 --quantization auto --out $OUT/llava.json > $OUT/llava.log 2>&1
echo "llava rc=$? $(( $(date +%s) - t0 ))s"
python3 -c "import json,os; d=json.load(open(os.environ['OUT']+'/llava.json'))['video']; print(d['ratios'], {k: (v['questions_per_s'], v['frames_per_s'], v.get('cache_hit_rate'), v.get('vision_passes')) for k, v in d['systems'].items()})"
grep -E "Error|Traceback" $OUT/llava.log | head -5
t0=$(date +%s)
timeout ${PREFILL_S:-70} python3 -P benchmarks/bench_gpu.py --parts prefill --tokenizer .gpu/smollm2 --out $OUT/prefill.json > $OUT/prefill.log 2>&1
echo "prefill rc=$? $(( $(date +%s) - t0 ))s"; tail -12 $OUT/prefill.log
t0=$(date +%s)
timeout ${SUITE_S:-240} python3 -P benchmarks/bench_suite.py --scale gpu --systems ${SYSTEMS:-sgnb,sgnb-no-overlap,sgnb-no-cuda-graph,hf-transformers} \
  --workloads ${WORKLOADS:-tree_of_thought,mmlu} --model dummy:llama-2-7b-smolvocab --tokenizer .gpu/smollm2 \
  --timeout ${CHILD_S:-60} --out $OUT/ablation.json > $OUT/ablation.log 2>&1
echo "ablation rc=$? $(( $(date +%s) - t0 ))s"
python3 - <<'PY'
import json, os
try:
    d = json.load(open(os.environ["OUT"] + "/ablation.json"))
except Exception as e:
    raise SystemExit(f"no ablation.json: {e}")
for w in d.get("workloads", []):
    print(w["name"], w["system"], w.get("status"), round(w.get("programs_per_s") or 0, 3), "p50", w.get("latency_p50_s"),
          "p99", w.get("latency_p99_s"), "steps", w.get("decode_steps"), "wall", w.get("wall_s"), "hit", w.get("cache_hit_rate"))
PY
grep -E "timeout|Error|Traceback" $OUT/ablation.log | head -8
