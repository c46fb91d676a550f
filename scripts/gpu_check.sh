#!/usr/bin/env bash
# Builds fsdp-cpp on a GPU machine against its preinstalled PyTorch (python3's torch wheel:
# libtorch 2.x with CUDA) and runs the test suite in parallel, within a time budget. Every other
# dependency comes from the folder scripts/gather_gpu_deps.sh fills beforehand on a machine
# with network (.gpu-deps/, ignored by git: bring it along with the checkout). docs/gpu.md.
#
#   bash scripts/gpu_check.sh [CTEST ARGS...]       e.g. -R 'test_fsdp_parity|test_collectives'
#
# Environment (optional): OUT (results folder, default ./gpu-results), FSDP_GPU_DEPS,
# FSDP_PYTHON (default python3), BUILD_DIR (default ./build-gpu), JOBS (build, default nproc),
# GPU_CHECK_TARGETS (build only these targets, e.g. to try the script on a small part),
# CTEST_JOBS (default 8: the multi-rank tests start 2-4 processes each), GPU_CHECK_BUDGET_S
# (the whole run, default 340 s: configure ~15 s, build ~2-3 min on 16 cores, tests get what is
# left; tests still running at the end are stopped and count as timeouts), GPU_CUDA_ARCH.
#
# Results, six files in the results folder:
#   summary.txt     machine, GPU, torch/CUDA versions, where each dependency came from, the
#                   time of every stage, the tests' counts, failures, skips and those not reached
#   configure.log   build.log   ctest.log (ctest --output-on-failure)   junit.xml (--output-junit)
#   details.tar.gz  ctest's LastTest.log (every test's output), CMakeCache.txt, CMake's own
#                   configure logs, nvidia-smi and nvidia-smi -q
# Exit status: 0 when the build and every test that ran passed.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
CTEST_JOBS=${CTEST_JOBS:-8}
BUDGET=${GPU_CHECK_BUDGET_S:-340}
: >"$SUMMARY"
rm -f "$RESULTS"/{configure.log,build.log,ctest.log,junit.xml,details.tar.gz}

finish() {
  local status=$1
  (
    cd "$RESULTS" || exit
    files=(.nvidia-smi.txt)
    if [[ -d "$BUILD" ]]; then
      for f in Testing/Temporary/LastTest.log CMakeCache.txt CMakeFiles/CMakeConfigureLog.yaml \
        CMakeFiles/CMakeOutput.log CMakeFiles/CMakeError.log; do
        [[ -f "$BUILD/$f" ]] && cp "$BUILD/$f" ".$(basename "$f")"
        [[ -f ".$(basename "$f")" ]] && files+=(".$(basename "$f")")
      done
    fi
    existing=()
    for f in "${files[@]}"; do [[ -f "$f" ]] && existing+=("$f"); done
    ((${#existing[@]})) && tar czf details.tar.gz --transform 's/^\.//' "${existing[@]}"
    rm -f "${existing[@]}"
  )
  cap_log "$RESULTS/build.log"
  cap_log "$RESULTS/ctest.log"
  note "time total        $((SECONDS - T0)) s (budget $BUDGET s)"
  note "result: $([[ $status == 0 ]] && echo PASS || echo FAIL)"
  exit "$status"
}

note "fsdp-cpp gpu_check: build against $PY's torch, ctest -j$CTEST_JOBS, budget ${BUDGET}s"
gpu_collect_machine_info
gpu_env_setup || finish 1

note "== configure"
stage configure - gpu_configure || { tail -30 "$RESULTS/configure.log"; finish 1; }

note "== build"
# Keep going past errors (-k 0): a first run on a new torch should show every broken file at
# once. The build gets the budget less 90 s kept for the tests.
build_limit=$((BUDGET - (SECONDS - T0) - 90))
((build_limit < 60)) && build_limit=60
build_ok=1
stage build "$RESULTS/build.log" timeout --kill-after=10 "$build_limit" \
  cmake --build "$BUILD" -j "$JOBS" ${GPU_CHECK_TARGETS:+--target $GPU_CHECK_TARGETS} -- -k 0 || build_ok=0
if ((!build_ok)); then
  note "build failed or ran out of time (limit ${build_limit}s); first errors:"
  grep -m 15 -E 'error:|FAILED:|undefined reference' "$RESULTS/build.log" | cut -c1-300 | sed 's/^/  /' | tee -a "$SUMMARY"
  note "built executables: $(ls "$BUILD/bin" 2>/dev/null | wc -l); ctest runs anyway (tests without their executable fail)"
fi

note "== tests"
test_limit=$((BUDGET - (SECONDS - T0) - 15))
((test_limit < 30)) && test_limit=30
stop_at=$(date -d "+$test_limit sec" +%H:%M:%S)
note "ctest -j$CTEST_JOBS, stop time $stop_at (in ${test_limit}s): tests still running then end as Timeout"
test_ok=1
stage tests "$RESULTS/ctest.log" timeout --kill-after=10 $((test_limit + 30)) \
  ctest --test-dir "$BUILD" -j "$CTEST_JOBS" --output-on-failure --stop-time "$stop_at" \
  --output-junit "$RESULTS/junit.xml" "$@" || test_ok=0

# Counts, failures, skips (as scripts/test.sh reports them) and the tests the budget left out.
grep -E '^[0-9]+% tests passed' "$RESULTS/ctest.log" | tee -a "$SUMMARY"
awk '/^The following tests FAILED:/ { on = 1; next } on && /^[ \t]+[0-9]+ - / { sub(/^[ \t]+/, "  FAILED "); print; next } { on = 0 }' \
  "$RESULTS/ctest.log" | tee -a "$SUMMARY"
last="$BUILD/Testing/Temporary/LastTest.log"
if [[ -f "$last" ]]; then
  skipped=$(awk '/^[0-9]+\/[0-9]+ Testing: / { test = $3 }
       /^SKIP: / { print "  " test ": " substr($0, 7) }
       skipped { print "  " test ": " $0; skipped = 0 }
       /: Skipped$/ { skipped = 1 }' "$last")
  note "skipped: ${skipped:+$'\n'}${skipped:-none}"
fi
all_tests=$(ctest --test-dir "$BUILD" -N "$@" 2>/dev/null | sed -n 's/^ *Test *#[0-9]*: //p' | sort)
ran_tests=$(sed -n 's/^ *[0-9]*\/[0-9]* Test *#[0-9]*: \([^ ]*\) .*/\1/p' "$RESULTS/ctest.log" | sort)
not_reached=$(comm -23 <(echo "$all_tests") <(echo "$ran_tests") | grep -v '^$' | tr '\n' ' ')
note "not reached within the budget: ${not_reached:-none}"
note "slowest tests:"
sed -n 's/^ *[0-9]*\/[0-9]* Test *#[0-9]*: \([^ ]*\) .* \([0-9.]*\) sec$/\2 \1/p' "$RESULTS/ctest.log" \
  | sort -rn | head -8 | sed 's/^/  /' | tee -a "$SUMMARY"

((build_ok && test_ok)) && finish 0
finish 1
