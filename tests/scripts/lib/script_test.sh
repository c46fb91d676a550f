# The common start of the script tests that drive the built tools. Source it right after
# `set -euo pipefail` (and after sim_hosts_require, which may SKIP before anything is made).
#
#   BIN                     $FSDP_BIN_DIR (ctest sets it: <build>/bin)
#   WORK                    a fresh temp directory, removed on exit (sim_hosts_create chains
#                           its own clean-up onto this trap)
#   require_tools TOOL...   each TOOL must be an executable in BIN
#   require_fashion_mnist   the dataset fsdp-train reads (sets DATA)
#   fail MSG                prints "FAIL: MSG" and the last FAIL_TAIL (default 25) lines of
#                           every $WORK/*.out, fsdp-train's progress lines (" step ") left
#                           out; exits 1
#   pass MSG                prints "ok: MSG"
#   now                     seconds since the epoch, with nanoseconds
#   wait_for SECONDS CMD... polls CMD every 50 ms until it succeeds (status 0) or SECONDS pass (1)
#   has_lines FILE N        FILE exists with at least N lines
#   PY, TORCHRUN, py_has    the Python and torchrun to use (lib/python.sh)
#   skip_test, skip_part    SKIP, or FAIL under CI=true / FSDP_REQUIRE_GPU=1 (lib/skip.sh)

BIN="${FSDP_BIN_DIR:?set FSDP_BIN_DIR to the bin directory of a build}"
# PY, TORCHRUN, py_has
# shellcheck source=python.sh
source "$(dirname "${BASH_SOURCE[0]}")/python.sh"
# shellcheck source=skip.sh
source "$(dirname "${BASH_SOURCE[0]}")/skip.sh"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

require_tools() {
  local t
  for t in "$@"; do
    [[ -x "$BIN/$t" ]] || { echo "FAIL: $BIN/$t is not an executable (build targets $*)"; exit 1; }
  done
}

require_fashion_mnist() {
  DATA=/usr/share/datasets/fashion-mnist
  [[ -f "$DATA/train-images-idx3-ubyte.gz" ]] || { echo "FAIL: $DATA missing (apt-get install dataset-fashion-mnist)"; exit 1; }
}

fail() {
  echo "FAIL: $*" >&2
  local f
  for f in "$WORK"/*.out; do
    [[ -f "$f" ]] || continue
    echo "--- $(basename "$f"):" >&2
    { grep -v ' step ' "$f" || true; } | tail -n "${FAIL_TAIL:-25}" >&2
  done
  exit 1
}
pass() { echo "ok: $*"; }
now() { date +%s.%N; }
wait_for() {
  local deadline=$(($1 * 20)) k
  shift
  for ((k = 0; k < deadline; k++)); do
    "$@" && return 0
    sleep 0.05
  done
  return 1
}
has_lines() { [[ -f "$1" && "$(wc -l <"$1")" -ge "$2" ]]; }
