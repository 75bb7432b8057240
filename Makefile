# The README's commands. `make demo` and `make test` work on a fresh machine: they create the
# virtual environment first (torch's CPU build is installed before anything else, so that pip
# does not pull a multi-GB CUDA build).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
DEMO := demo

.PHONY: setup demo test test-all bench lint clean real-model

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,ray]'
	touch $@

$(DEMO)/model/config.json: | setup
	$(BIN)/python scripts/make_tiny_model.py $(DEMO)/model --layers 4 --hidden 256 --heads 4 --kv-heads 2 --intermediate 768 --vocab 2048

$(DEMO)/prompts.parquet: | setup
	$(BIN)/python scripts/make_demo_data.py $(DEMO)

$(DEMO)/adder/config.json: | setup
	$(BIN)/python scripts/demo_adder.py train $(DEMO)/adder

$(DEMO)/adder.parquet: | setup
	$(BIN)/python scripts/demo_adder.py data $@

# the quick start: train the adder, ask it 200 questions (4 samples each, then greedy), count the
# right answers; the random model and the other jobs' data are made too (jobs/*.yaml use them)
demo: setup $(DEMO)/adder/config.json $(DEMO)/adder.parquet $(DEMO)/model/config.json $(DEMO)/prompts.parquet
	$(BIN)/batchgen run jobs/quickstart.yaml --fresh
	$(BIN)/batchgen run jobs/quickstart.yaml --fresh --quiet --set output.path=../out/quickstart-greedy --set sampling.n=1 --set sampling.temperature=0
	$(BIN)/python scripts/demo_adder.py check out/quickstart out/quickstart-greedy

# `make test`: everything but the tests marked slow (kill-and-resume, Ray clusters, kernel
# compilation): a few minutes on two cores. `make test-all`: every test; CI (.ci/run) runs it.
# Both check the import layers first (import-linter contracts in pyproject.toml).
test: setup
	$(BIN)/lint-imports
	$(BIN)/pytest -x -m "not slow"

test-all: setup
	$(BIN)/lint-imports
	$(BIN)/pytest -x

# the real model of the demo and the tests (SmolLM2-135M-Instruct, Q4_1 GGUF), once per machine
real-model: setup
	$(BIN)/python scripts/fetch_real_model.py

bench: setup
	$(BIN)/python scripts/bench.py

lint: setup
	$(BIN)/ruff check batchgen kernels tests scripts

clean:
	rm -rf $(DEMO) out
