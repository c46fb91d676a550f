#!/usr/bin/env bash
# Builds fsdp-cpp against a second torch wheel (default: the newest on PyPI we know of, 2.15.0)
# and runs the tests whose subject changes between libtorch 2.x releases: the agent store's
# wire protocol (test_fsdp_run: the wheel's own Python TCPStore client; test_dist_init: its
# C++ client), parameter-group options (test_cpu_adam), Gloo's headers against the wheel's
# library (test_gloo_abi). CI runs the pinned version only (scripts/test.sh); run this by hand
# when a new torch appears:
#
#   scripts/check_torch_versions.sh [VERSION]      # e.g. 2.15.0
#
# The wheel goes into its own environment (.venv-VERSION/, ignored) and the build into
# build-torch-VERSION/. Needs ~5 GB of disk and a clean build's time (~15 min on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${1:-2.15.0}
VENV=.venv-$VERSION
BUILD=build-torch-$VERSION

FSDP_TORCH_VERSION=$VERSION FSDP_VENV=$VENV bash scripts/bootstrap.sh
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFSDP_PYTHON="$PWD/$VENV/bin/python"
cmake --build "$BUILD" -j "$(nproc)" --target fsdp-run test_dist_init test_cpu_adam test_gloo_abi
ctest --test-dir "$BUILD" --output-on-failure -R '^(test_fsdp_run|test_dist_init|test_cpu_adam|test_gloo_abi)$'
echo "check_torch_versions: torch $VERSION passed"
