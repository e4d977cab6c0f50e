#!/usr/bin/env bash
# TPU check: the TPU kernel tests compiled for the real chip, the kernels timed against
# JAX's own, and the engine step on the TPU kernels, in a few minutes. Logs and JSON go to
# $OUT; a short table is printed last.
#
#   OUT=/some/dir bash experiments/tpu_check.sh           # on a TPU VM (python3 with jax[tpu])
#   OUT=/tmp/tc PYTHON=.venv/bin/python bash experiments/tpu_check.sh --dry-run
#
# --dry-run runs the same steps on CPU: kernels in the TPU interpreter, fast tests only,
# tiny benchmark sizes (checks this script without a TPU). Every step has its own timeout;
# a failing or timed-out step is recorded and the next one still runs. A step that cannot
# run is recorded as SKIP. Exit status: 0 only if no step failed.
#
# Files in $OUT: env.txt, tests.log, engine.log, engine_*.json, kernel_bench.log,
# tpu_kernel_bench.json, summary.txt.
# Knobs (environment): PYTHON (default python3), PYTEST_WORKERS (default 1: one process
# owns the TPU), KERNEL_BENCH_FLAGS (replace the default benchmark flags).

set -u -o pipefail

CHECK_NAME=tpu_check STEP_WIDTH=16 SKIP_RC=3
# shellcheck source=experiments/check_lib.sh
source "$(dirname "$0")/check_lib.sh"
check_setup "$@"

if [[ $DRY_RUN == 1 ]]; then
  export JAX_PLATFORMS=cpu PAGED_JAX_TEST_COMPILED=0
  TEST_MARK=(-m "not slow")
  # The engine in the TPU interpreter: about 6 minutes for 4 prompts x 32 tokens on a
  # loaded 2-core host (the reference backend: about 1).
  T_ENV=60; T_TESTS=900; T_ENGINE=900; T_KB=600
  KB_FLAGS="${KERNEL_BENCH_FLAGS:---dry_run}"
  ENGINE_BACKEND="pallas_interpret:tpu"
else
  export JAX_PLATFORMS=tpu PAGED_JAX_TEST_COMPILED=1
  TEST_MARK=()
  T_ENV=120; T_TESTS=600; T_ENGINE=300; T_KB=600
  KB_FLAGS="${KERNEL_BENCH_FLAGS:---batch=8,64,256 --context=4096 --block_size=16,64}"
  ENGINE_BACKEND="pallas:tpu"
fi
WORKERS="${PYTEST_WORKERS:-1}"

# 1. Environment.
{
  date -u
  git rev-parse HEAD 2>/dev/null || true
} > "$OUT/env.txt"
step env "$T_ENV" "$OUT/env.txt" "$PY" -c "import sys, jax, jaxlib; \
print(sys.version); print('jax', jax.__version__, 'jaxlib', jaxlib.__version__); \
d = jax.devices(); print(len(d), 'devices:', d[0].device_kind, d)"

# 2. Kernel tests: compiled on the TPU (the interpreter in --dry-run); on a TPU they also
#    compare against JAX's RPA kernel itself, which the interpreter cannot run.
step tests "$T_TESTS" "$OUT/tests.log" "$PY" -m pytest -q -rfEs -p no:cacheprovider \
  $( [[ $WORKERS -gt 1 ]] && echo "-n $WORKERS" ) ${TEST_MARK[@]+"${TEST_MARK[@]}"} \
  tests/tpu_kernels_test.py tests/tpu_kv_write_test.py tests/tpu_work_test.py

# 3. The engine end to end on the TPU kernels vs the reference backend (shipped model,
#    greedy): the token lists must be equal (SKIP where the engine refuses the backend).
engine_check() {
  local be
  for be in reference "$ENGINE_BACKEND"; do
    if ! "$PY" -m experiments.generate --prompt_ids="1,2,3,4,5;10,20,30;7;65,66,67,68,69,70" \
        --max_tokens=32 --attention_backend="$be" > "$OUT/engine_${be//:/_}.json" 2> "$WORK/err"; then
      cat "$WORK/err"
      if grep -q "must be one of.*got '$be'" "$WORK/err"; then
        echo "engine does not take attention_backend=$be"; return 3
      fi
      return 1
    fi
  done
  cmp "$OUT/engine_reference.json" "$OUT/engine_${ENGINE_BACKEND//:/_}.json" \
    && echo "engine outputs equal"
}
export -f engine_check
export PY OUT WORK ENGINE_BACKEND
step engine "$T_ENGINE" "$OUT/engine.log" bash -c engine_check

# 4. Kernel timings vs JAX's RPA and JAX's decode kernel, % of HBM bandwidth
#    (experiments/tpu_kernel_bench.py).
# shellcheck disable=SC2086
step kernel_bench "$T_KB" "$OUT/kernel_bench.log" "$PY" -m experiments.tpu_kernel_bench \
  --out="$WORK/kernel_bench" --compilation_cache=none $KB_FLAGS
cp "$WORK/kernel_bench/tpu_kernel_bench.json" "$OUT/" 2>/dev/null || true
rm -rf "$WORK"

# Short table last.
echo
echo "---- tests ----"
tests_tail "$OUT/tests.log"
tail -1 "$OUT/engine.log" || true
echo "---- tpu_kernel_bench ----"
grep -E "^\|" "$OUT/kernel_bench.log" | tail -24 || true
finish
