#!/usr/bin/env bash
# Sets up a fresh machine and runs the main job, fsdp-train, on its embedded
# default (2 local ranks, FULL_SHARD, MLP on Fashion-MNIST). Extra arguments go
# to fsdp-train (see `build/bin/fsdp-train --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}

bash scripts/bootstrap.sh
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build "$BUILD_DIR" -j "$(nproc)" --target fsdp-train fsdp-run
exec "$BUILD_DIR/bin/fsdp-train" "$@"
