# Shared by experiments/gpu_check.sh and experiments/tpu_check.sh (sourced, not run): the
# set-up of a check run, its timed steps and its closing table.
#
#   CHECK_NAME=gpu_check STEP_WIDTH=22 SKIP_RC= ; source "$(dirname "$0")/check_lib.sh"
#   check_setup "$@"        # DRY_RUN, OUT (default ./$CHECK_NAME_out), PY, WORK, SUMMARY
#   step NAME SECONDS LOGFILE CMD...
#   tests_tail LOG...       # failures of the first log, the pytest counts of each
#   finish                  # the steps table; exits 0 only if no step failed
#
# CHECK_NAME prefixes the progress lines; STEP_WIDTH is the summary's name column; a step
# whose command exits SKIP_RC (unset: none) is recorded as SKIP, not as a failure.

# check_setup [--dry-run]: repository root as cwd, $OUT made, the environment exported.
check_setup() {
  DRY_RUN=0
  if [[ "${1:-}" == "--dry-run" ]]; then DRY_RUN=1; fi
  cd "$(dirname "$0")/.."
  OUT="${OUT:-$PWD/${CHECK_NAME}_out}"
  mkdir -p "$OUT"
  PY="${PYTHON:-python3}"
  WORK="$(mktemp -d)"
  export PYTHONUNBUFFERED=1
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  export TF_CPP_MIN_LOG_LEVEL=1
  SUMMARY="$OUT/summary.txt"
  : > "$SUMMARY"
  FAILED=0
}

# step NAME SECONDS LOGFILE CMD...: runs CMD under timeout, appends to LOGFILE, records rc.
step() {
  local name=$1 limit=$2 log=$3
  shift 3
  local t0=$SECONDS rc
  echo "=== $name: $* (timeout ${limit}s)" >> "$log"
  timeout --kill-after=10 "$limit" "$@" >> "$log" 2>&1
  rc=$?
  local status=ok
  if [[ $rc == 124 || $rc == 137 ]]; then status=TIMEOUT; elif [[ -n "${SKIP_RC:-}" && $rc == "$SKIP_RC" ]]; then
    status=SKIP; elif [[ $rc != 0 ]]; then status=FAIL; fi
  if [[ $status == FAIL || $status == TIMEOUT ]]; then FAILED=1; fi
  printf "%-${STEP_WIDTH}s %-8s rc=%-4s %4ss\n" "$name" "$status" "$rc" "$((SECONDS - t0))" \
    >> "$SUMMARY"
  echo "[$CHECK_NAME] $name: $status (rc=$rc, $((SECONDS - t0))s)"
}

# tests_tail LOG...: the first log's failed tests (20 at most), then each log's pytest counts.
tests_tail() {
  grep -E "^(FAILED|ERROR) " "$1" | head -20 || true
  local log
  for log in "$@"; do
    grep -E "(passed|failed|error)" "$log" | tail -1 || true
  done
}

# finish: the steps table last; exit status 0 only if no step failed or timed out.
finish() {
  echo "---- steps ($SECONDS s total; logs and JSON in $OUT) ----"
  cat "$SUMMARY"
  exit $FAILED
}
