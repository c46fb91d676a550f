#!/usr/bin/env bash
# The skip rules ([Note: skips] in tests/harness/skips.h, tests/scripts/lib/skip.sh), on the
# built binaries, on any machine, in a few seconds:
#   - a test binary exits 77 (ctest: skipped) only when every case it ran skipped for want of a
#     GPU; a pass beside such a skip passes, a skip for another reason passes, and a failure that
#     says "no CUDA device" fails;
#   - under CI=true or FSDP_REQUIRE_GPU=1 every skip fails, with one "skip not allowed" line;
#   - a GTEST_SKIP inside the ranks of run_ranks fails the test, naming the ranks;
#   - test_cuda_comm, the gpu test, skips where torch sees no GPU (and fails when strict);
#   - every ctest entry reads the skip from the exit status (SKIP_RETURN_CODE 77), none from
#     the output (SKIP_REGULAR_EXPRESSION);
#   - a script test's skip_test / skip_part follow the same rules.
# The subjects are the hidden (DISABLED_) cases of test_harness_skips. This test itself runs
# under CI=true in CI: the children that check the lenient rules run without the strict modes.
set -euo pipefail
# shellcheck source=lib/script_test.sh
source "$(dirname "$0")/lib/script_test.sh"
require_tools test_harness_skips test_cuda_comm
OUT="$WORK/run.out"
LIB="$(dirname "$0")/lib"

# run [VAR=VALUE...] COMMAND ARGS...: COMMAND without the strict modes unless VAR=VALUE sets one;
# output to $OUT, status in RC.
run() { RC=0; env -u CI -u FSDP_REQUIRE_GPU "$@" >"$OUT" 2>&1 || RC=$?; }
# The hidden cases' binary, and only CASE...: the --gtest_filter argument that selects them.
HIDDEN=("$BIN/test_harness_skips" --gtest_also_run_disabled_tests)
only() {
  local filter="" c
  for c in "$@"; do filter+="${filter:+:}HarnessSkips.DISABLED_$c"; done
  echo "--gtest_filter=$filter"
}
expect_status() { [[ "$RC" == "$1" ]] || fail "$2: exit status $RC, want $1"; }
# A strict failure: not 0, and not 77, which ctest would count as a skip.
expect_failed() { [[ "$RC" != 0 && "$RC" != 77 ]] || fail "$1: exit status $RC, want a failure (not 0, not 77)"; }
expect_output() { grep -qF -- "$1" "$OUT" || fail "$2: '$1' not in the output"; }

run "${HIDDEN[@]}" "$(only NeedsMoreGpusThanAnyMachine)"
expect_status 77 "only a GPU skip"
expect_output "[  SKIPPED ] HarnessSkips.DISABLED_NeedsMoreGpusThanAnyMachine" "only a GPU skip"
for mode in CI=true FSDP_REQUIRE_GPU=1; do
  run "$mode" "${HIDDEN[@]}" "$(only NeedsMoreGpusThanAnyMachine)"
  expect_failed "only a GPU skip, $mode"
  expect_output "skip not allowed under $mode: HarnessSkips.DISABLED_NeedsMoreGpusThanAnyMachine: " "only a GPU skip, $mode"
done
pass "a selection of GPU skips only: 77, and under CI=true or FSDP_REQUIRE_GPU=1 a failure naming the case"

run "${HIDDEN[@]}" "$(only Passes NeedsMoreGpusThanAnyMachine)"
expect_status 0 "a pass and a GPU skip"
run "${HIDDEN[@]}" "$(only SkipsForAnotherReason)"
expect_status 0 "a skip for another reason"
run CI=true "${HIDDEN[@]}" "$(only SkipsForAnotherReason)"
expect_failed "a skip for another reason, CI=true"
expect_output "skip not allowed under CI=true: HarnessSkips.DISABLED_SkipsForAnotherReason: a reason that is not a missing GPU" \
  "a skip for another reason, CI=true"
pass "a pass beside a GPU skip: 0; a skip for another reason: 0, under CI=true a failure"

run "${HIDDEN[@]}" "$(only FailsSayingNoCudaDevice)"
expect_failed "a failure that says \"no CUDA device\""
expect_output "no CUDA device" "a failure that says \"no CUDA device\""
run "${HIDDEN[@]}" "$(only FailsSayingNoCudaDevice NeedsMoreGpusThanAnyMachine)"
expect_failed "a failure beside a GPU skip"
pass "a failure stays a failure, whatever its message says"

run "${HIDDEN[@]}" "$(only SkipsInsideRanks)"
expect_failed "a skip inside the ranks"
expect_output "skips must be decided before run_ranks, in the parent test" "a skip inside the ranks"
expect_output "(rank 0 skipped (decided by rank 0), rank 1 skipped (decided by rank 1) inside the body of run_ranks" \
  "a skip inside the ranks"
pass "a GTEST_SKIP inside run_ranks fails the test, naming the ranks"

# test_cuda_comm, the gpu test itself, wherever torch sees no GPU (on a GPU machine it runs as
# its own ctest entry).
run "${HIDDEN[@]}" "$(only NeedsOneGpu)"
if [[ $RC == 77 ]]; then
  run "$BIN/test_cuda_comm"
  expect_status 77 "test_cuda_comm without a GPU"
  expect_output "no CUDA device visible to torch" "test_cuda_comm without a GPU"
  for mode in CI=true FSDP_REQUIRE_GPU=1; do
    run "$mode" "$BIN/test_cuda_comm"
    expect_failed "test_cuda_comm without a GPU, $mode"
    expect_output "skip not allowed under $mode: CudaComm.NcclAtOneRank: no CUDA device" "test_cuda_comm, $mode"
  done
  pass "test_cuda_comm without a GPU: 77, and a failure under CI=true or FSDP_REQUIRE_GPU=1"
else
  expect_status 0 "a case that needs one GPU, with torch seeing one"
  pass "torch sees a GPU here: test_cuda_comm runs as a gpu test of its own"
fi

# ctest's view: the exit status decides, never the output. ctest reads a copy of the build's test
# lists, since even a listing rewrites Testing/Temporary/LastTest.log, which the ctest running
# this test is writing.
(cd "$BIN/.." && find . -name CTestTestfile.cmake) | while read -r f; do
  mkdir -p "$WORK/ctest/$(dirname "$f")"
  cp "$BIN/../$f" "$WORK/ctest/$f"
done
"$PY" - "$WORK/ctest" <<'PY' >"$OUT" 2>&1 || fail "ctest's skip properties"
import json, subprocess, sys
tests = json.loads(subprocess.run(["ctest", "--test-dir", sys.argv[1], "--show-only=json-v1"],
                                  check=True, capture_output=True, text=True).stdout)["tests"]
assert tests, "ctest lists no test"
bad = []
for t in tests:
    props = {p["name"]: p["value"] for p in t.get("properties", [])}
    if "SKIP_REGULAR_EXPRESSION" in props:
        bad.append(f'{t["name"]}: SKIP_REGULAR_EXPRESSION {props["SKIP_REGULAR_EXPRESSION"]}')
    if str(props.get("SKIP_RETURN_CODE")) != "77":
        bad.append(f'{t["name"]}: SKIP_RETURN_CODE {props.get("SKIP_RETURN_CODE")}, want 77')
assert not bad, "\n".join(bad)
print(len(tests))
PY
pass "all $(cat "$OUT") ctest entries: SKIP_RETURN_CODE 77, no SKIP_REGULAR_EXPRESSION"

# The script tests' helper.
run bash -c "source '$LIB/skip.sh'; skip_part 'one part'; echo 'the rest ran'; skip_test 'the whole test'"
expect_status 77 "skip_test"
expect_output "SKIP: one part" "skip_part"
expect_output "the rest ran" "skip_part"
expect_output "SKIP: the whole test" "skip_test"
for mode in CI=true FSDP_REQUIRE_GPU=1; do
  run "$mode" bash -c "source '$LIB/skip.sh'; skip_test 'the whole test'"
  expect_status 1 "skip_test, $mode"
  expect_output "FAIL: skip not allowed under $mode: the whole test" "skip_test, $mode"
  run "$mode" bash -c "source '$LIB/skip.sh'; skip_part 'one part'; echo 'the rest ran'"
  expect_status 1 "skip_part, $mode"
  ! grep -q "the rest ran" "$OUT" || fail "skip_part, $mode: the test went on"
done
pass "lib/skip.sh: SKIP and 77 (skip_part goes on), under CI=true or FSDP_REQUIRE_GPU=1 FAIL and 1"
echo "PASS: test_skip_rules"
