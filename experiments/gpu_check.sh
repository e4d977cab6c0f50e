#!/usr/bin/env bash
# GPU check: the kernel tests compiled for the real GPU, then the kernel benchmarks, in
# under 5 minutes, then calibrates the device-time model. Logs and JSON go to $OUT; a short
# table is printed last.
#
#   OUT=/some/dir bash experiments/gpu_check.sh            # on the GPU machine (python3)
#   OUT=/tmp/gc PYTHON=.venv/bin/python bash experiments/gpu_check.sh --dry-run
#
# --dry-run runs the same steps on CPU: interpreted kernels, fast tests only, tiny bench
# sizes (checks this script without a GPU). Every step has its own timeout; a failing or
# timed-out step is recorded and the next one still runs. Exit status: 0 only if every
# step passed.
#
# Files in $OUT: env.txt, tests.log, mosaic_tests.log, engine.log, engine_*.json,
# kernel_bench.log, kernel_bench.json, ragged_bench.log, ragged_bench.json,
# perf_calibrate.log, perf_calibrate.json, summary.txt.
# Knobs (environment): PYTHON (default python3), PYTEST_WORKERS (default 8),
# KERNEL_BENCH_FLAGS, RAGGED_BENCH_FLAGS, CALIBRATE_FLAGS (replace the default flags).

set -u -o pipefail

CHECK_NAME=gpu_check STEP_WIDTH=22 SKIP_RC=
# shellcheck source=experiments/check_lib.sh
source "$(dirname "$0")/check_lib.sh"
check_setup "$@"
# Several pytest workers and the benchmarks share one GPU: allocate on demand.
export XLA_PYTHON_CLIENT_PREALLOCATE=false

if [[ $DRY_RUN == 1 ]]; then
  export JAX_PLATFORMS=cpu PAGED_JAX_TEST_COMPILED=0
  TEST_MARK=(-m "not slow")
  WORKERS="${PYTEST_WORKERS:-2}"
  T_TESTS=900; T_MOSAIC=600; T_ENGINE=300; T_KB=600; T_RB=600; T_CAL=600
  KB_FLAGS="${KERNEL_BENCH_FLAGS:---batch=1 --context=512 --block_size=16 --repeats=2}"
  RB_FLAGS="${RAGGED_BENCH_FLAGS:---dry_run --scenarios=decode64,mixed --block_size=16 --repeats=2}"
  CAL_FLAGS="${CALIBRATE_FLAGS:---dry_run}"
else
  export JAX_PLATFORMS=cuda PAGED_JAX_TEST_COMPILED=1
  TEST_MARK=()
  WORKERS="${PYTEST_WORKERS:-8}"
  T_TESTS=150; T_MOSAIC=120; T_ENGINE=90; T_KB=90; T_RB=100; T_CAL=180
  KB_FLAGS="${KERNEL_BENCH_FLAGS:---batch=1,8,64,256 --context=4096 --block_size=16,64,128}"
  RB_FLAGS="${RAGGED_BENCH_FLAGS:-}"
  CAL_FLAGS="${CALIBRATE_FLAGS:---model=llama-3-8b --gpu=h200 --num_layers=4}"
fi

# 1. Environment.
{
  date -u
  git rev-parse HEAD 2>/dev/null || true
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem \
    --format=csv 2>&1 || echo "nvidia-smi unavailable"
} > "$OUT/env.txt"
step env 60 "$OUT/env.txt" "$PY" -c "import sys, jax, jaxlib; \
print(sys.version); print('jax', jax.__version__, 'jaxlib', jaxlib.__version__); \
print(jax.devices())"

# 2. Kernel tests: compiled on the GPU (interpreted in --dry-run), slow grid included,
#    plus the CUDA lowering tests under this machine's JAX.
step tests "$T_TESTS" "$OUT/tests.log" "$PY" -m pytest -q -rfE -p no:cacheprovider \
  -n "$WORKERS" ${TEST_MARK[@]+"${TEST_MARK[@]}"} \
  tests/ragged_paged_attention_test.py tests/paged_attention_test.py \
  tests/cuda_lowering_ragged_test.py tests/cuda_lowering_test.py

# 2b. Mosaic GPU kernels (compiled on sm_90: their interpret grids stay in the CPU suite) and
#     the gpu_backend dispatch.
step mosaic_tests "$T_MOSAIC" "$OUT/mosaic_tests.log" "$PY" -m pytest -q -rfE -p no:cacheprovider \
  -n "$WORKERS" -m "not slow" tests/mosaic_paged_attention_test.py \
  tests/mosaic_ragged_paged_attention_test.py tests/gpu_backends_test.py

# 2c. The engine end to end on this machine's attention backend vs the reference backend
#     (shipped model, greedy, multi-step decode): the token lists must be equal.
engine_check() {
  local be
  for be in reference auto; do
    "$PY" -m experiments.generate --prompt_ids="1,2,3,4,5;10,20,30;7;65,66,67,68,69,70" \
      --max_tokens=48 --decode_steps_per_sync=4 --attention_backend="$be" \
      > "$OUT/engine_$be.json" || return 1
  done
  cmp "$OUT/engine_reference.json" "$OUT/engine_auto.json" && echo "engine outputs equal"
}
export -f engine_check
export PY OUT
step engine "$T_ENGINE" "$OUT/engine.log" bash -c engine_check

# 3. Decode kernel benchmark (experiments/kernel_bench.py).
# shellcheck disable=SC2086
step kernel_bench "$T_KB" "$OUT/kernel_bench.log" "$PY" -m experiments.kernel_bench \
  --out="$WORK/kernel_bench" $KB_FLAGS
cp "$WORK/kernel_bench/kernel_bench.json" "$OUT/" 2>/dev/null || true

# 4. Ragged (mixed prefill + decode) benchmark.
# shellcheck disable=SC2086
step ragged_bench "$T_RB" "$OUT/ragged_bench.log" "$PY" -m experiments.ragged_bench \
  --out="$WORK/ragged_bench" $RB_FLAGS
cp "$WORK/ragged_bench/ragged_bench.json" "$OUT/" 2>/dev/null || true

# 5. Calibration of the device-time model (experiments/perf_calibrate.py): step times of a
#    random Llama-3-8B-shaped model (4 of its layers) over a grid of batch shapes, the
#    model's efficiencies fitted to half the batches, the error predicting the other half.
# shellcheck disable=SC2086
step perf_calibrate "$T_CAL" "$OUT/perf_calibrate.log" "$PY" -m experiments.perf_calibrate \
  --out="$WORK/perf_calibrate" $CAL_FLAGS
cp "$WORK/perf_calibrate/perf_calibrate.json" "$OUT/" 2>/dev/null || true
rm -rf "$WORK"

# Short table last.
echo
echo "---- tests ----"
tests_tail "$OUT/tests.log" "$OUT/mosaic_tests.log"
tail -1 "$OUT/engine.log" || true
echo "---- kernel_bench ----"
grep -E "^\|" "$OUT/kernel_bench.log" | tail -12 || true
echo "---- ragged_bench ----"
grep -E "^\||^variant" "$OUT/ragged_bench.log" | tail -20 || true
echo "---- perf_calibrate ----"
grep -E "^fit:" "$OUT/perf_calibrate.log" | tail -1 || true
finish
