#!/usr/bin/env bash
# Our binaries link the CUDA build of the torch wheel. They must start where no GPU driver is
# installed (libcuda.so.1 absent: this machine and CI's), and load exactly one copy of each CUDA
# library, the wheel's (nvidia-* packages beside torch), never one from a system toolkit
# (/usr/local/cuda) mixed with the wheel's: two CUDA runtimes or NCCLs in one process break
# in ways no error names.
set -euo pipefail
source "$(dirname "$0")/lib/script_test.sh"
require_tools fsdp-train fsdp-ckpt test_gloo_abi
PY="${FSDP_PYTHON:?ctest sets FSDP_PYTHON to the Python whose torch the build uses}"
SITE="$("$PY" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')"

for exe in fsdp-train fsdp-ckpt test_gloo_abi; do
  libs="$(LD_TRACE_LOADED_OBJECTS=1 "$BIN/$exe")" || fail "$exe: the loader cannot resolve its libraries"
  ! grep -q 'not found' <<<"$libs" || fail "$exe: missing libraries: $(grep 'not found' <<<"$libs")"
  for lib in libtorch_cuda libc10_cuda libcudart libnccl libcublas libcudnn; do
    paths="$(grep -oE "=> [^ ]*/$lib\.so[^ ]*" <<<"$libs" | cut -c4- | sort -u || true)"
    [[ -n "$paths" ]] || fail "$exe: $lib is not loaded (the wheel's CUDA build links it)"
    [[ "$(wc -l <<<"$paths")" == 1 ]] || fail "$exe: $lib is loaded from several places: $paths"
    [[ "$(realpath "$paths")" == "$(realpath "$SITE")"/* ]] ||
      fail "$exe: $lib comes from $paths, not from the wheel's packages under $SITE"
  done
  ! grep -qE 'libcuda\.so' <<<"$libs" || fail "$exe: needs the driver library libcuda.so at load time"
done
pass "fsdp-train, fsdp-ckpt, test_gloo_abi: one CUDA runtime, cuBLAS, cuDNN and NCCL each, all the wheel's; no driver library needed"

# They start and run on CPU without a driver: the case that matters, on CPU machines (this one,
# CI's). A GPU machine's run (FSDP_REQUIRE_GPU=1) has a driver by design: there the same commands
# run with it, and nothing is skipped. Anywhere else a driver leaves the case untested: a skip.
driver=without
grep -q 'libcuda\.so\.1' <<<"$(ldconfig -p)" && driver=with
"$BIN/fsdp-ckpt" inspect "${FSDP_SOURCE_DIR:?}/tests/fixtures/ckpt-1.13/full_shard/step-10" >"$WORK/inspect.out" 2>&1 ||
  fail "fsdp-ckpt inspect failed $driver a GPU driver"
"$BIN/test_gloo_abi" --gtest_filter='GlooAbi.OptionsLayoutAgreesWithTheLibrary' >"$WORK/abi.out" 2>&1 ||
  fail "test_gloo_abi failed to run $driver a GPU driver"
if [[ $driver == without ]]; then
  pass "without libcuda.so.1: fsdp-ckpt inspects a checkpoint, a torch test runs"
elif [[ "${FSDP_REQUIRE_GPU:-}" == 1 && "${CI:-}" != true ]]; then
  pass "with libcuda.so.1 (a GPU machine): fsdp-ckpt inspects a checkpoint, a torch test runs"
else
  skip_part "libcuda.so.1 is installed on this machine; the start without a driver is not tested"
fi
echo "PASS: test_runtime_libraries"
