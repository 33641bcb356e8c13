#!/usr/bin/env bash
# Diagnose a suite child on the GPU: run it in-process with engine logs on and dump every thread's stack if it
# has not finished after $2 seconds.   bash benchmarks/gpu/debug_child.sh WORKLOAD SECONDS LIMIT
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site
python3 -P - "$1" "$2" "$3" <<'PY'
import faulthandler, logging, runpy, sys
workload, seconds, limit = sys.argv[1], float(sys.argv[2]), sys.argv[3]
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(threadName)s %(name)s: %(message)s")
faulthandler.dump_traceback_later(seconds, exit=True)
sys.argv = ["bench_suite.py", "--child", workload, "sgnb", "--scale", "gpu", "--model", "dummy:llama-2-7b-smolvocab",
            "--tokenizer", ".gpu/smollm2", "--limit", limit]
runpy.run_path("benchmarks/bench_suite.py", run_name="__main__")
PY
