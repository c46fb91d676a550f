#!/usr/bin/env bash
# Every ctest entry of this build is in exactly one lane, quick, multirank or slow, with gpu beside
# it where it needs one (scripts/check_test_lanes.py against the build's tests); and the check fails,
# naming the test, on copies of the build's test files where a test lost its lane, got a second
# one, or got a label that is no lane.
set -euo pipefail
SRC="${FSDP_SOURCE_DIR:?set FSDP_SOURCE_DIR to the source tree}"
BUILD=$(cd "${FSDP_BIN_DIR:?set FSDP_BIN_DIR to the bin directory of a build}/.." && pwd)
PY="${FSDP_PYTHON:-python3}"
check() { "$PY" "$SRC/scripts/check_test_lanes.py" "$1" 2>&1; }
status=0
# shellcheck source=lib/planted.sh
source "$(dirname "$0")/lib/planted.sh"

if out=$(check "$BUILD"); then
  echo "$out"
else
  echo "FAIL: the tests of $BUILD are not one lane each:"
  echo "$out"
  status=1
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# plant NAME SED EXPECTED: the check fails on a copy of the build's test files that SED edited on
# the properties line of test_core_units (a quick test), with a line containing EXPECTED.
plant() {
  local copy="$work/$1"
  mkdir -p "$copy"
  (cd "$BUILD" && find . -name CTestTestfile.cmake -not -path '*/CMakeFiles/*' -exec cp --parents {} "$copy" \;)
  sed -i "/^set_tests_properties(\[=\[test_core_units\]=\]/ $2" "$copy/tests/CTestTestfile.cmake"
  if cmp -s "$BUILD/tests/CTestTestfile.cmake" "$copy/tests/CTestTestfile.cmake"; then
    echo "FAIL: $1: '$2' changed nothing on the properties line of test_core_units"
    status=1
  else
    expect_fails "$1" "$3" check "$copy"
  fi
}
plant no-lane 's/ LABELS "quick"//' "test test_core_units has no lane"
plant two-lanes 's/ LABELS "quick"/ LABELS "quick;slow"/' "test test_core_units is in 2 lanes (quick, slow)"
plant typo 's/ LABELS "quick"/ LABELS "quik"/' "test test_core_units has the label 'quik'"

((status == 0)) && echo "PASS: test_lanes"
exit "$status"
