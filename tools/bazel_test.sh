#!/usr/bin/env bash
# Runs the Bazel test suite offline: `bazel test //...` against the project's virtualenv.
#
#   tools/bazel_test.sh                        # every test target (slow tests deselected)
#   tools/bazel_test.sh //tests:kv_cache_test  # chosen targets
#   tools/bazel_test.sh --config=slow //...    # also @pytest.mark.slow tests
#   VENV=/path/to/venv tools/bazel_test.sh     # another interpreter (default: ./.venv)
#
# Installs Debian's bazel-bootstrap (Bazel 4.2.3) with apt-get when no `bazel` is on PATH.
# Creates the venv with `make install` when it is missing. Bazel's output base stays in
# ~/.cache/bazel (outside the repo); only the ignored bazel-* convenience links appear here.
set -euo pipefail
cd "$(dirname "$0")/.."
repo_root="$PWD"

venv="${VENV:-$repo_root/.venv}"
case "$venv" in /*) ;; *) venv="$repo_root/$venv" ;; esac
python="$venv/bin/python"

if ! command -v bazel >/dev/null 2>&1; then
  echo "bazel_test.sh: bazel not found; installing Debian's bazel-bootstrap" >&2
  sudo_cmd=()
  if [ "$(id -u)" != 0 ]; then sudo_cmd=(sudo); fi
  "${sudo_cmd[@]}" apt-get update -q
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -q bazel-bootstrap
fi

if [ ! -x "$python" ]; then
  if [ -z "${VENV:-}" ]; then
    make install
  else
    echo "bazel_test.sh: no interpreter at $python (VENV=$VENV)" >&2
    exit 2
  fi
fi

# Arguments starting with "-" are Bazel flags (use the --flag=value form); the rest are targets.
flags=()
targets=()
for arg in "$@"; do
  case "$arg" in
    -*) flags+=("$arg") ;;
    *) targets+=("$arg") ;;
  esac
done
if [ ${#targets[@]} -eq 0 ]; then targets=(//...); fi

exec bazel test --python_path="$python" ${flags[@]+"${flags[@]}"} -- "${targets[@]}"
