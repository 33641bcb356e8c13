#!/usr/bin/env bash
# Third device call of issue 11: the eager engine's decode step, triton vs flashinfer, warmed up per batch size.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
mkdir -p ~/.cache && tar xzf .gpu/flashinfer-cache.tgz -C ~/.cache
timeout 120 python3 benchmarks/bench_attention.py --no-layers --engine --backends triton,flashinfer --steps 24 \
  --tokenizer .gpu/smollm2 --out $OUT/engine.json 2> $OUT/engine.log; echo "rc=$?"; grep '^{' $OUT/engine.log | cut -c1-300
