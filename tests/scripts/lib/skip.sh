# shellcheck shell=bash
# How a script test skips, by the rules the gtest binaries follow ([Note: skips] in
# tests/harness/skips.h): "SKIP: why" on stdout, and exit 77 (ctest: skipped) when nothing of the
# test can run. Under CI=true (.ci/run) or FSDP_REQUIRE_GPU=1 (a GPU machine's run) no skip is
# allowed: the same call prints "FAIL: skip not allowed under <mode>: why" and exits 1.
#
#   skip_test WHY    the test cannot run its subject here: SKIP and exit 77, or FAIL
#   skip_part WHY    one part cannot run here and the rest goes on: SKIP, or FAIL and exit 1
#   strict_modes     prints the strict modes set ("CI=true", "FSDP_REQUIRE_GPU=1", both joined by
#                    " and "), nothing when none is

strict_modes() {
  local modes=""
  [[ "${CI:-}" == true ]] && modes="CI=true"
  [[ "${FSDP_REQUIRE_GPU:-}" == 1 ]] && modes="${modes:+$modes and }FSDP_REQUIRE_GPU=1"
  printf '%s' "$modes"
}

skip_part() {
  local modes
  modes="$(strict_modes)"
  if [[ -n "$modes" ]]; then
    echo "FAIL: skip not allowed under $modes: $*" >&2
    exit 1
  fi
  echo "SKIP: $*"
}

skip_test() {
  skip_part "$@"
  exit 77
}
