# The Python the script tests run, and its torchrun. Sourced by lib/script_test.sh and by the
# scripts that do not source it.
#
#   PY              FSDP_PYTHON (ctest sets it to the interpreter whose torch wheel the build
#                   links, tests/CMakeLists.txt), else python3 from PATH
#   TORCHRUN        that Python's torchrun, as a command: "${TORCHRUN[@]}" ARGS...
#   py_has MODULE   PY imports MODULE (e.g. torch.distributed.run)
#   PY_MISSING      what to do when PY has no torch, for the SKIP/FAIL lines
#
# Threads: the wheel's torch (MKL, oneDNN, OpenMP) starts as many intra-op threads as cores;
# scripts that compare numbers with the library's export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
# before any torch loads, and the Python references call torch.set_num_threads(1) as well.
PY="${FSDP_PYTHON:-python3}"
TORCHRUN=("$PY" -m torch.distributed.run)
PY_MISSING="set FSDP_PYTHON to a Python with torch 2.11 (ctest does: the build's .venv)"
py_has() { "$PY" -c "import $1" >/dev/null 2>&1; }
