#!/usr/bin/env bash
# Installs every Debian package fsdp-cpp needs. Idempotent: installs only what is
# missing and runs `apt-get update` at most once per call.
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build
  libtorch-dev          # libtorch 1.13.1 (CPU) with c10d
  libgloo-dev           # Gloo headers c10d's ProcessGroupGloo needs
  libopenblas0-pthread  # without it libtorch falls back to the reference BLAS (~50x slower)
  googletest libgtest-dev libgmock-dev
  libbenchmark-dev
  libhwy-dev            # Google Highway: runtime-dispatched SIMD for CPUAdam
  libcli11-dev nlohmann-json3-dev
  python3-torch         # interop tests and the Python DDP baseline (/usr/bin/python3)
  python3-matplotlib    # tools/plot_memory_trace.py (optional: the script says so when missing)
  dataset-fashion-mnist # data of the default training job
  libdeflate0           # fast CRC-32 for checkpoints (loaded at run time; zlib is the fallback)
  zlib1g-dev            # fsdp-train reads the gzip'd IDX files
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if ((${#missing[@]} == 0)); then
  echo "bootstrap: all ${#PACKAGES[@]} packages present"
  exit 0
fi

SUDO=""
if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
echo "bootstrap: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
echo "bootstrap: done"
