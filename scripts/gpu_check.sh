#!/usr/bin/env bash
# Builds fsdp-cpp on a GPU machine against its preinstalled PyTorch (python3's torch wheel:
# libtorch 2.x with CUDA) and runs the test suite in parallel, within a time budget. Every other
# dependency comes from the folder scripts/gather_gpu_deps.sh fills beforehand on a machine
# with network (.gpu-deps/, ignored by git: bring it along with the checkout). docs/gpu.md.
#
#   bash scripts/gpu_check.sh -L gpu                  the gpu-labelled tests (the device run)
#   bash scripts/gpu_check.sh [CTEST ARGS...]         e.g. -LE gpu, or -R 'test_fsdp_parity'
#   GPU_CHECK_DRY_RUN=1 bash scripts/gpu_check.sh -L gpu
#                                                     all but the build and the tests, anywhere
#
# What it builds: with `-L gpu` among the arguments, only the targets in scripts/gpu_targets.txt
# (checked against the configured build's gpu tests by scripts/check_gpu_targets.py); with any
# other selection, everything. GPU_CHECK_TARGETS overrides that (a list, or `all`).
#
# Environment (optional): OUT (results folder, default ./gpu-results), FSDP_GPU_DEPS,
# FSDP_PYTHON (default python3), BUILD_DIR (default ./build-gpu), JOBS (build, default nproc),
# GPU_CHECK_TARGETS, CTEST_JOBS (default 8: the multi-rank tests start 2-4 processes each),
# GPU_CHECK_BUDGET_S (the whole run, default 330 s: machine and configure ~20 s, the build, tests
# get what is left; tests still running at the end are stopped and count as timeouts),
# GPU_CHECK_BUILD_S (the build's own limit, default 150 s), GPU_CUDA_ARCH, GPU_CHECK_DRY_RUN=1.
#
# Results, six files in the results folder (nothing else is written outside the build folder):
#   summary.txt     machine, GPU, torch/CUDA versions, where each dependency came from, the
#                   time of every stage and the total, the tests' counts, failures, skips and
#                   those not reached
#   configure.log   build.log   ctest.log (ctest --output-on-failure)   junit.xml (--output-junit)
#   details.tar.gz  ctest's LastTest.log (every test's output), CMakeCache.txt, CMake's own
#                   configure logs, nvidia-smi and nvidia-smi -q
# Exit status: 0 when the build and every test that ran passed (a dry run: when the machine,
# the dependencies, the configure and the target list are right).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
CTEST_JOBS=${CTEST_JOBS:-8}
BUDGET=${GPU_CHECK_BUDGET_S:-330}
BUILD_LIMIT=${GPU_CHECK_BUILD_S:-150}
DRY_RUN=${GPU_CHECK_DRY_RUN:-0}
: >"$SUMMARY"
rm -f "$RESULTS"/{configure.log,build.log,ctest.log,junit.xml,details.tar.gz}

# The gpu label alone needs only the targets its tests run; other selections build everything.
gpu_label=0
prev=""
for arg in "$@"; do
  [[ "$prev" =~ ^(-L|--label-regex)$ && "$arg" == gpu ]] && gpu_label=1
  prev=$arg
done
if [[ -n "${GPU_CHECK_TARGETS+set}" ]]; then
  targets=${GPU_CHECK_TARGETS:-all}
  check_list=0
elif ((gpu_label)); then
  targets=$(sed 's/#.*//' "$FSDP_ROOT/scripts/gpu_targets.txt" | xargs)
  check_list=1
else
  targets=all
  check_list=0
fi
# The gpu label on a GPU machine: every case must run, and the test harness fails one that
# skips. Other selections keep their skips (the simulated hosts need `ip`, which it may lack).
((gpu_label)) && export FSDP_REQUIRE_GPU=1

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
  note "result: $([[ $status == 0 ]] && echo PASS || echo FAIL)$( ((DRY_RUN)) && echo ' (dry run: nothing built, no test run)')"
  exit "$status"
}

# The names of the tests a selection (ctest arguments) holds.
test_names() { ctest --test-dir "$BUILD" -N "$@" 2>/dev/null | sed -n 's/^ *Test *#[0-9]*: //p'; }
# shellcheck disable=SC2317 # called through stage
check_targets() { "$PY" "$FSDP_ROOT/scripts/check_gpu_targets.py" "$BUILD" 2>&1 | tee -a "$SUMMARY"; }

note "fsdp-cpp gpu_check: build against $PY's torch, ctest -j$CTEST_JOBS, budget ${BUDGET}s$( ((DRY_RUN)) && echo ', dry run')"
stage machine - gpu_collect_machine_info
stage deps - gpu_env_setup || finish 1

note "== configure"
# Tests on, explicitly: gpu_bench.sh configures the same folder with them off.
stage configure - gpu_configure -DFSDP_BUILD_TESTS=ON || { tail -30 "$RESULTS/configure.log"; finish 1; }

list_ok=1
if ((check_list)); then
  note "== targets: $targets"
  stage targets - check_targets || list_ok=0
fi

# Keep going past errors (-k 0): a first run on a new torch should show every broken file at
# once. The build gets its own limit, or the budget less 90 s kept for the tests if that is less.
build_limit=$((BUDGET - (SECONDS - T0) - 90))
((build_limit > BUILD_LIMIT)) && build_limit=$BUILD_LIMIT
((build_limit < 60)) && build_limit=60
read -r -a target_args <<<"$targets"
build_cmd=(cmake --build "$BUILD" -j "$JOBS" --target "${target_args[@]}" -- -k 0)
ctest_args=(--test-dir "$BUILD" -j "$CTEST_JOBS" --output-on-failure --output-junit "$RESULTS/junit.xml" "$@")
# Listed before the run: every ctest call, -N too, rewrites the build's LastTest.log. The stub
# that leaves, or an earlier run's log, would pass for this run's in details.tar.gz.
names=$(test_names "$@")
rm -f "$BUILD/Testing/Temporary/LastTest.log"

if ((DRY_RUN)); then
  note "== dry run: the build and the tests are left out"
  note "would build (at most ${build_limit}s): ${build_cmd[*]}"
  note "would test (until the budget's end): ${FSDP_REQUIRE_GPU:+FSDP_REQUIRE_GPU=1 }ctest --stop-time HH:MM:SS ${ctest_args[*]}"
  note "tests it would run ($(grep -c . <<<"$names")): $(tr '\n' ' ' <<<"$names")"
  ((list_ok)) && [[ -n "$names" ]] && finish 0
  finish 1
fi

note "== build"
build_ok=1
stage build "$RESULTS/build.log" timeout --kill-after=10 "$build_limit" "${build_cmd[@]}" || build_ok=0
if ((!build_ok)); then
  note "build failed or ran out of time (limit ${build_limit}s); first errors:"
  grep -m 15 -E 'error:|FAILED:|undefined reference' "$RESULTS/build.log" | cut -c1-300 | sed 's/^/  /' | tee -a "$SUMMARY"
  note "built executables: $(find "$BUILD/bin" -maxdepth 1 -type f 2>/dev/null | wc -l); ctest runs anyway (tests without their executable fail)"
fi

note "== tests"
test_limit=$((BUDGET - (SECONDS - T0) - 15))
((test_limit < 30)) && test_limit=30
stop_at=$(date -d "+$test_limit sec" +%H:%M:%S)
note "ctest -j$CTEST_JOBS, stop time $stop_at (in ${test_limit}s): tests still running then end as Timeout"
test_ok=1
stage tests "$RESULTS/ctest.log" timeout --kill-after=10 $((test_limit + 30)) \
  ctest --stop-time "$stop_at" "${ctest_args[@]}" || test_ok=0

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
all_tests=$(sort <<<"$names")
ran_tests=$(sed -n 's/^ *[0-9]*\/[0-9]* Test *#[0-9]*: \([^ ]*\) .*/\1/p' "$RESULTS/ctest.log" | sort)
not_reached=$(comm -23 <(echo "$all_tests") <(echo "$ran_tests") | grep -v '^$' | tr '\n' ' ')
note "not reached within the budget: ${not_reached:-none}"
note "slowest tests:"
sed -n 's/^ *[0-9]*\/[0-9]* Test *#[0-9]*: \([^ ]*\) .* \([0-9.]*\) sec$/\2 \1/p' "$RESULTS/ctest.log" \
  | sort -rn | head -8 | sed 's/^/  /' | tee -a "$SUMMARY"

((build_ok && test_ok && list_ok)) && finish 0
finish 1
