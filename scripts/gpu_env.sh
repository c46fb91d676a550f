# shellcheck shell=bash
# Sourced by scripts/gpu_check.sh and scripts/gpu_bench.sh: the environment and the CMake
# configure for building fsdp-cpp on a GPU machine against its preinstalled PyTorch, with every
# other dependency from the folder scripts/gather_gpu_deps.sh filled (no network there).
#
# Inputs (environment, all optional):
#   OUT                  results folder (default <checkout>/gpu-results)
#   FSDP_GPU_DEPS        the gathered folder (default <checkout>/.gpu-deps)
#   FSDP_PYTHON          the Python whose torch is built against (default python3)
#   BUILD_DIR            build folder (default <checkout>/build-gpu)
#   JOBS                 build jobs (default nproc)
#   FSDP_GPU_ZLIB        auto (default: the machine's zlib where it has zlib.h and libz.so, else
#                        the gathered one) or gathered
#   GPU_CUDA_ARCH        compute capability to build for, e.g. 9.0 (default: nvidia-smi's, or
#                        torch's for device 0; none found: torch's CMake picks its own list)
# Sets RESULTS, DEPS, PY, BUILD, JOBS, SUMMARY and the functions note, stage, gpu_env_setup,
# gpu_configure, gpu_collect_machine_info.

FSDP_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
RESULTS=${OUT:-$FSDP_ROOT/gpu-results}
DEPS=${FSDP_GPU_DEPS:-$FSDP_ROOT/.gpu-deps}
PY=${FSDP_PYTHON:-python3}
BUILD=${BUILD_DIR:-$FSDP_ROOT/build-gpu}
JOBS=${JOBS:-$(nproc)}
mkdir -p "$RESULTS"
RESULTS=$(cd "$RESULTS" && pwd)
SUMMARY=$RESULTS/summary.txt
MULTIARCH_LIB=usr/lib/x86_64-linux-gnu
T0=$SECONDS

# note MSG...: a line in summary.txt and on stdout.
note() { echo "$*" | tee -a "$SUMMARY"; }
# stage NAME LOG CMD...: runs CMD with its output into LOG (- for none: the terminal), notes
# its duration and exit status; returns that status.
stage() {
  local name=$1 log=$2 t=$SECONDS rc=0
  shift 2
  echo "=== $name: $*"
  if [[ "$log" == - ]]; then "$@" || rc=$?; else "$@" >"$log" 2>&1 || rc=$?; fi
  note "$(printf 'time %-12s %4d s  exit %d  (at %d s)' "$name" $((SECONDS - t)) "$rc" $((SECONDS - T0)))"
  return "$rc"
}

gpu_collect_machine_info() {
  note "== machine"
  note "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)   host: $(uname -srm)"
  note "os: $(. /etc/os-release 2>/dev/null && echo "${PRETTY_NAME:-?}")   cores: $(nproc)   memory: $(free -g 2>/dev/null | awk '/^Mem:/ {print $2 " GiB"}')"
  note "gcc: $(gcc --version 2>/dev/null | head -1)"
  note "cmake: $(cmake --version 2>/dev/null | head -1)   ninja: $(ninja --version 2>/dev/null)"
  note "nvcc: $(nvcc --version 2>/dev/null | grep -o 'release .*' || echo none on PATH)"
  # A copied tree (the GPU machine's) may come without its .git.
  local commit
  commit=$(git -C "$FSDP_ROOT" log -1 --format='%h %s' 2>/dev/null | cut -c1-100)
  note "git: ${commit:-none (a tree without .git)} $(git -C "$FSDP_ROOT" status --porcelain 2>/dev/null | grep -qv '^??' && echo '(with uncommitted changes)')"
  if command -v nvidia-smi >/dev/null; then
    note "gpu: $(nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version --format=csv,noheader 2>&1 | head -4 | tr '\n' ';')"
    nvidia-smi >"$RESULTS/.nvidia-smi.txt" 2>&1 || true
    nvidia-smi -q >>"$RESULTS/.nvidia-smi.txt" 2>&1 || true
  else
    note "gpu: no nvidia-smi"
  fi
  note "python: $PY -> $(command -v "$PY" || echo "$PY: not found")"
  note "torch: $("$PY" -c 'import torch, sys
cuda = torch.cuda.is_available()
print(torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version(),
      "cxx11abi", torch.compiled_with_cxx11_abi(), "python", sys.version.split()[0],
      "| cuda available:", cuda, "|", torch.cuda.get_device_name(0) if cuda else "-",
      torch.cuda.get_device_capability(0) if cuda else "")' 2>&1 | tail -1)"
  note "gathered deps: $DEPS ($(du -sh "$DEPS" 2>/dev/null | cut -f1))"
}

# Exports what the build, the tests and the consumer projects the tests configure
# (test_examples: find_package(fsdp) -> hwy, Torch) need.
gpu_env_setup() {
  if [[ ! -f "$DEPS/MANIFEST.txt" ]]; then
    note "FAIL: $DEPS/MANIFEST.txt missing: run scripts/gather_gpu_deps.sh on a machine with network first, and bring $DEPS along"
    return 1
  fi
  DEPS=$(cd "$DEPS" && pwd)
  local lib="$DEPS/root/$MULTIARCH_LIB" torch_prefix
  # nvcc: torch's CMake package enables CUDA whenever its libtorch has it.
  if ! command -v nvcc >/dev/null && [[ -x /usr/local/cuda/bin/nvcc ]]; then
    export PATH="/usr/local/cuda/bin:$PATH"
    note "nvcc: added /usr/local/cuda/bin to PATH"
  fi
  # One GPU architecture: sets torch's nvcc flags (TORCH_CUDA_ARCH_LIST) and CMake's CUDA
  # default (CUDAARCHS), and spares torch's configure its GPU-detection program. Torch's CMake
  # still warns that it ignores CMAKE_CUDA_ARCHITECTURES: CMake defines that variable whenever
  # CUDA is enabled, and fsdp-cpp compiles no CUDA itself, so the warning is harmless.
  local cap=${GPU_CUDA_ARCH:-}
  if [[ -z "$cap" ]] && command -v nvidia-smi >/dev/null; then
    cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' ')
  fi
  if [[ -z "$cap" ]]; then
    cap=$("$PY" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability(0)) if torch.cuda.is_available() else None' 2>/dev/null | grep -E '^[0-9]+\.[0-9]+$' || true)
  fi
  if [[ "$cap" =~ ^[0-9]+\.[0-9]+$ ]]; then
    export TORCH_CUDA_ARCH_LIST=$cap CUDAARCHS=${cap/./}
    note "cuda arch: $cap (TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST, CUDAARCHS=$CUDAARCHS)"
  else
    unset TORCH_CUDA_ARCH_LIST CUDAARCHS
    note "cuda arch: no GPU found; torch's CMake chooses"
  fi
  torch_prefix=$("$PY" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)' 2>/dev/null) || torch_prefix=""
  export CMAKE_PREFIX_PATH="$DEPS/root/usr${torch_prefix:+:$torch_prefix}${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
  # libhwy.so.1 and libdeflate.so.0 at run time (the build's executables also carry an RPATH to
  # the first), and libraries named bare (-lhwy, -lz) by the installed fsdp package at link time.
  export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export LIBRARY_PATH="$lib${LIBRARY_PATH:+:$LIBRARY_PATH}"
  # zlib: the machine's own when it has the headers and libz.so, else the gathered one (its own
  # prefix, so Debian's libz.so.1 never shadows the machine's at run time).
  ZLIB_ARGS=()
  # FSDP_GPU_ZLIB=gathered forces the gathered one (to try that path on a machine with zlib).
  if [[ "${FSDP_GPU_ZLIB:-auto}" != gathered ]] && echo '#include <zlib.h>' | gcc -E -x c - >/dev/null 2>&1 &&
    [[ "$(gcc -print-file-name=libz.so)" == /* ]]; then
    note "zlib: the machine's ($(gcc -print-file-name=libz.so))"
  else
    ZLIB_ARGS=(-DZLIB_INCLUDE_DIR="$DEPS/zlib/usr/include" -DZLIB_LIBRARY="$DEPS/zlib/$MULTIARCH_LIB/libz.so")
    export LIBRARY_PATH="$DEPS/zlib/$MULTIARCH_LIB:$LIBRARY_PATH"
    note "zlib: the gathered one ($DEPS/zlib)"
  fi
  # Fashion-MNIST: fsdp-train's script tests read /usr/share/datasets/fashion-mnist.
  local data=/usr/share/datasets/fashion-mnist
  if [[ -f "$data/train-images-idx3-ubyte.gz" ]]; then
    note "fashion-mnist: the machine's $data"
  elif [[ -d "$DEPS/data$data" && ! -e "$data" ]] && mkdir -p "$(dirname "$data")" 2>/dev/null && ln -sfn "$DEPS/data$data" "$data" 2>/dev/null; then
    note "fashion-mnist: linked $data -> $DEPS/data$data"
  else
    note "fashion-mnist: missing ($data not writable or not gathered): fsdp-train's script tests will fail"
  fi
}

# gpu_configure [CMAKE ARGS...]: configures $BUILD; the output in $RESULTS/configure.log.
gpu_configure() {
  local lib="$DEPS/root/$MULTIARCH_LIB" extra=()
  # CMake 4 refuses packages that ask for policies older than 3.5; ours ask for newer, this is
  # the safety net for the rest.
  [[ "$(cmake --version | sed -n 's/^cmake version \([0-9]*\).*/\1/p')" -ge 4 ]] && extra+=(-DCMAKE_POLICY_VERSION_MINIMUM=3.5)
  [[ -n "${TORCH_CUDA_ARCH_LIST:-}" ]] && extra+=(-DTORCH_CUDA_ARCH_LIST="$TORCH_CUDA_ARCH_LIST")
  cmake -S "$FSDP_ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DFSDP_PYTHON="$PY" \
    -DFSDP_GLOO_INCLUDE_DIR="$DEPS/root/usr/include" \
    -Dhwy_DIR="$lib/cmake/hwy" \
    -DGTest_DIR="$lib/cmake/GTest" \
    -Dnlohmann_json_DIR="$DEPS/root/usr/share/cmake/nlohmann_json" \
    -DCLI11_DIR="$DEPS/root/usr/share/cmake/CLI11" \
    "${ZLIB_ARGS[@]}" "${extra[@]}" "$@" >"$RESULTS/configure.log" 2>&1
  local rc=$?
  grep -E '^-- fsdp:' "$RESULTS/configure.log" | sed 's/^/  /' | tee -a "$SUMMARY"
  grep -E '^CMake (Warning|Error)' "$RESULTS/configure.log" | sort | uniq -c | sed 's/^ */  /' | tee -a "$SUMMARY"
  # Where each dependency came from, as the cache has it.
  grep -E '^(hwy_DIR|GTest_DIR|nlohmann_json_DIR|CLI11_DIR|Torch_DIR|FSDP_GLOO_INCLUDE_DIR|ZLIB_INCLUDE_DIR|ZLIB_LIBRARY_RELEASE|ZLIB_LIBRARY|CMAKE_CUDA_COMPILER|CMAKE_CUDA_ARCHITECTURES|TORCH_CUDA_ARCH_LIST):' \
    "$BUILD/CMakeCache.txt" 2>/dev/null | sed 's/^/  /' | tee -a "$SUMMARY"
  return "$rc"
}

# Keeps a log under the 16 MiB a returned file may have: its first and last 6 MiB.
cap_log() {
  local f=$1 max=$((15 * 1024 * 1024))
  [[ -f "$f" && $(stat -c %s "$f") -gt $max ]] || return 0
  { head -c $((6 * 1024 * 1024)) "$f"; printf '\n\n[... %s cut to its first and last 6 MiB ...]\n\n' "$(basename "$f")"; tail -c $((6 * 1024 * 1024)) "$f"; } >"$f.cut"
  mv "$f.cut" "$f"
}
