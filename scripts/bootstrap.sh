#!/usr/bin/env bash
# Installs everything fsdp-cpp needs on a fresh Debian machine, and nothing twice:
#   1. Debian packages (compiler, CMake, Gloo's headers, test and benchmark libraries, data);
#   2. libtorch: the pinned PyTorch wheel from PyPI, in a virtual environment inside the
#      checkout (.venv/, ignored by git), which CMake finds by itself (cmake/FindTorchWheel.cmake).
# A second run checks what is there and installs nothing. FSDP_TORCH_VERSION picks another
# wheel (scripts/check_torch_versions.sh uses it with FSDP_VENV for a second environment).
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_VERSION=${FSDP_TORCH_VERSION:-2.11.0}  # the GPU machines' torch; the oldest we support
VENV=${FSDP_VENV:-.venv}

PACKAGES=(
  build-essential cmake ninja-build
  libgloo-dev           # Gloo's headers for c10d's ProcessGroupGloo.hpp (the wheel ships none)
  googletest libgtest-dev libgmock-dev
  libbenchmark-dev
  libhwy-dev            # Google Highway: runtime-dispatched SIMD for CPUAdam
  libcli11-dev nlohmann-json3-dev
  python3 python3-venv  # the interpreter the wheel's environment is made from
  dataset-fashion-mnist # data of the default training job
  libdeflate0           # fast CRC-32 for checkpoints (loaded at run time; zlib is the fallback)
  zlib1g-dev            # fsdp-train reads the gzip'd IDX files
  iproute2              # simulated hosts in the multi-host tests (ip netns, veth, tc)
)

install_debian_packages() {
  local missing=() p
  for p in "${PACKAGES[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
      missing+=("$p")
    fi
  done
  if ((${#missing[@]} == 0)); then
    echo "bootstrap: all ${#PACKAGES[@]} Debian packages present"
    return
  fi
  local sudo=""
  [[ $(id -u) -ne 0 ]] && sudo="sudo"
  echo "bootstrap: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
}

# The environment is reused when its torch is the pinned version; otherwise it is made anew.
venv_has_torch() {
  [[ -x "$VENV/bin/python" ]] &&
    "$VENV/bin/python" -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" \
      2>/dev/null
}

install_torch_wheel() {
  if venv_has_torch; then
    echo "bootstrap: torch $TORCH_VERSION present in $VENV"
    return
  fi
  local python=python3
  # A Python that cannot make environments (Debian's without python3-venv) is not used.
  python3 -c 'import ensurepip, venv' 2>/dev/null || python=/usr/bin/python3
  echo "bootstrap: installing torch $TORCH_VERSION into $VENV (the wheel and its CUDA libraries: ~4.7 GB)"
  rm -rf "$VENV"
  "$python" -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --no-cache-dir --disable-pip-version-check "torch==$TORCH_VERSION"
  venv_has_torch || { echo "bootstrap: torch $TORCH_VERSION did not install into $VENV" >&2; exit 1; }
}

# Python packages the tests read or write files with, beside torch: installed into an
# environment that lacks them, whether it was made now or reused.
#   numpy: torch's tensor interop in the Python tests; matplotlib: tools/plot_memory_trace.py;
#   safetensors: Hugging Face's reader and writer, the reference of tests/scripts/test_safetensors_interop.sh.
PY_PACKAGES=(numpy matplotlib safetensors)

install_python_packages() {
  local missing=() p
  for p in "${PY_PACKAGES[@]}"; do
    "$VENV/bin/python" -c "import $p" 2>/dev/null || missing+=("$p")
  done
  if ((${#missing[@]} == 0)); then
    echo "bootstrap: ${PY_PACKAGES[*]} present in $VENV"
    return
  fi
  echo "bootstrap: installing ${missing[*]} into $VENV"
  "$VENV/bin/pip" install --quiet --no-cache-dir --disable-pip-version-check "${missing[@]}"
}

install_debian_packages
install_torch_wheel
install_python_packages
echo "bootstrap: done"
