#!/usr/bin/env bash
# Device call 3 of 2026-12-02 (session 6): LLaVA-NeXT-Video-7B shape (random weights) video Q&A on the H200: sgnb vs
# radix off vs HF generate per question, 2 videos x 4 questions, 8 frames each. PyAV carried in .whl-av; no
# FlashInfer (the carry limit), so the engine's attention is our Triton kernels.
#   device run:  bash benchmarks/gpu/s6_run3.sh     (carry: .whl-min .whl-av .gpu)
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-min/*.whl .whl-av/*.whl || exit 1
mkdir -p ~/.triton && tar xzf .gpu/triton-cache.tgz -C ~/.triton 2>/dev/null
python3 -P -c "import sgnb, av; print('packages ok', av.__version__)" || exit 1
t0=$(date +%s)
timeout ${LLAVA_S:-300} python3 -P benchmarks/bench_llava.py --model dummy:llava-next-video-7b --images 0 --videos 2 \
  --frames 8 --device cuda --tokenizer .gpu/smollm2 --quantization auto --out $OUT/llava.json > $OUT/llava.log 2>&1
echo "llava rc=$? $(( $(date +%s) - t0 ))s"
python3 -c "import json,os; d=json.load(open(os.environ['OUT']+'/llava.json'))['video']; print(d['ratios'], d['greedy_outputs_equal_to_hf']); [print(k, v) for k, v in d['systems'].items()]"
grep -E "Error|Traceback|error" $OUT/llava.log | head -8
