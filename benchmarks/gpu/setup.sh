#!/usr/bin/env bash
# Sourced by the device-call scripts: install the carried wheels (FlashInfer's JIT wheel, xgrammar, the sgnb wheel
# built here) into /tmp/site and unpack the carried kernel caches (FlashInfer's JIT builds, Triton's compiles).
#   carry: .whl (the wheels) and .gpu (smollm2 tokenizer files, flashinfer-cache.tgz, triton-cache.tgz)
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site SGNB_TEST_TOKENIZER=$PWD/.gpu/smollm2
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
for cache in flashinfer:.cache triton:.triton; do
  tgz=.gpu/${cache%%:*}-cache.tgz
  if [ -f "$tgz" ]; then mkdir -p ~/"${cache#*:}" && tar xzf "$tgz" -C ~/"${cache#*:}"; fi
done
