# The common start of the fsdp-train tests (test_fsdp_train.sh, test_fsdp_train_zero.sh):
# lib/script_test.sh, fsdp-train and fsdp-run built, Fashion-MNIST installed, and
#   TRAIN        the fsdp-train executable
#   OUT          where run writes (fail shows its last 40 lines)
#   run ARGS...  fsdp-train ARGS with output to $OUT; sets RC
# One thread, set before torch loads: the wheel's torch runs GEMMs in MKL (and oneDNN) with
# as many OpenMP threads as cores by default, and GEMM rounding follows the thread count (the
# Python references run with one thread too, from the same wheel's libtorch).
# shellcheck source=script_test.sh
source "$(dirname "${BASH_SOURCE[0]}")/script_test.sh"
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
require_tools fsdp-train fsdp-run
require_fashion_mnist
TRAIN="$BIN/fsdp-train"
OUT="$WORK/run.out"
FAIL_TAIL=40
run() { RC=0; "$TRAIN" "$@" >"$OUT" 2>&1 || RC=$?; }
