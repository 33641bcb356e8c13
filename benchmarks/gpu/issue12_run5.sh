#!/usr/bin/env bash
# Device call 5 of 2026-12-01 (session 2): why the suite's decode workloads timed out at GPU scale (call 4).
set -u
source benchmarks/gpu/setup.sh
t0=$(date +%s)
timeout 90 bash benchmarks/gpu/debug_child.sh chat_short 70 16 > $OUT/chat.out 2> $OUT/chat.err
echo "chat rc=$? $(( $(date +%s) - t0 ))s"; cut -c1-400 $OUT/chat.out | tail -2; grep -v "^\s*$" $OUT/chat.err | tail -45 | cut -c1-250
t0=$(date +%s)
timeout 70 bash benchmarks/gpu/debug_child.sh mmlu_select 55 16 > $OUT/sel.out 2> $OUT/sel.err
echo "select rc=$? $(( $(date +%s) - t0 ))s"; cut -c1-300 $OUT/sel.out | tail -2; grep -v "^\s*$" $OUT/sel.err | tail -25 | cut -c1-250
