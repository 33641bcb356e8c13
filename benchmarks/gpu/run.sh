#!/usr/bin/env bash
# One device call: the carried wheels and caches set up (setup.sh), then each STEP in order under its own time
# limit, its output in $OUT/NAME.log and a line "== NAME rc=.. Ns" on stdout.
#
#   device run:  bash benchmarks/gpu/run.sh STEP ...        (carry: .whl .gpu; see setup.sh for what they hold)
#
# A STEP is one quoted argument:
#   "suite NAME SECONDS WORKLOADS SYSTEMS [bench_suite options...]"   the suite at GPU scale on the 7B-shaped dummy
#                                                                     (--model/--tokenizer/--scale preset; e.g.
#                                                                     --warm, --timeout 60); JSON in $OUT/NAME.json
#   "script NAME SECONDS PATH [args...]"                              any Python script (python3 -P PATH args)
#   "tests NAME SECONDS [pytest args...]"                             pytest on the device (GPU tests)
# e.g. bash benchmarks/gpu/run.sh "suite cold 240 mmlu,hellaswag sgnb,hf --timeout 90" \
#        "script bench 300 benchmarks/bench_gpu.py --out \$OUT/gpu.json"
# What each call ran and what came of it is written down in benchmarks/results/NOTES.md (the one-off scripts of
# the calls before 2026-12-04 are in the git history, up to commit 6a0eb4b).
set -u
source benchmarks/gpu/setup.sh
for spec in "$@"; do
  read -r -a words <<< "$spec"
  words=("${words[@]//\$OUT/$OUT}")  # a literal $OUT in a step names the call's output folder
  kind=${words[0]} name=${words[1]} limit=${words[2]}
  case $kind in
    suite)
      step "$name" "$limit" python3 -P benchmarks/bench_suite.py --scale gpu --model dummy:llama-2-7b-smolvocab \
        --tokenizer .gpu/smollm2 --workloads "${words[3]}" --systems "${words[4]}" "${words[@]:5}" --out "$OUT/$name.json"
      [ -f "$OUT/$name.json" ] && python3 benchmarks/gpu/suite_summary.py "$OUT/$name.json" ;;
    script)
      step "$name" "$limit" python3 -P "${words[@]:3}"
      tail -n 20 "$OUT/$name.log" ;;
    tests)
      step "$name" "$limit" python3 -P -m pytest --maxfail=15 "${words[@]:3}"
      tail -n 15 "$OUT/$name.log" ;;
    *) echo "unknown step kind $kind (suite, script, tests)"; exit 2 ;;
  esac
done
ls "$OUT"/*timeout.txt 2>/dev/null && head -c 4000 "$OUT"/*timeout.txt
exit 0
