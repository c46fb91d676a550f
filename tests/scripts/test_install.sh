#!/usr/bin/env bash
# `cmake --install` then `find_package(fsdp)` from a separate consumer project:
# the consumer builds, links and runs a one-rank FSDP step.
set -euo pipefail
BUILD_DIR=$(cd "$FSDP_BIN_DIR/.." && pwd)
work=$(mktemp -d /tmp/fsdp-install-XXXXXX)
trap 'rm -rf "$work"' EXIT

cmake --install "$BUILD_DIR" --prefix "$work/prefix" > "$work/install.log"
test -f "$work/prefix/lib/cmake/fsdp/fsdpConfig.cmake" || { echo "FAIL: no fsdpConfig.cmake installed"; exit 1; }
test -f "$work/prefix/include/fsdp/fsdp/fully_sharded.h" || { echo "FAIL: headers not installed"; exit 1; }

mkdir -p "$work/consumer"
cat > "$work/consumer/CMakeLists.txt" <<'CMAKE'
cmake_minimum_required(VERSION 3.22)
project(consumer CXX)
set(CMAKE_CXX_STANDARD 17)
find_package(fsdp REQUIRED)
add_executable(consumer main.cpp)
target_link_libraries(consumer PRIVATE fsdp::fsdp)
CMAKE
cat > "$work/consumer/main.cpp" <<'CPP'
#include <iostream>
#include <torch/torch.h>
#include "fsdp/dist/process_group.h"
#include "fsdp/fsdp/fully_sharded.h"
int main() {
  auto pg = fsdp::dist::init_process_group(
      fsdp::dist::InitOptions().file_store_path(std::string(std::getenv("STORE"))).overrides([] {
        fsdp::dist::LaunchOverrides o; o.rank = 0; o.world_size = 1; return o; }()));
  torch::manual_seed(0);
  auto model = fsdp::FullyShardedDataParallel(torch::nn::Sequential(torch::nn::Linear(4, 3)), pg);
  torch::optim::SGD opt(model->parameters(), 0.1);
  auto loss = model->forward(torch::ones({2, 4})).sum();
  loss.backward();
  opt.step();
  std::cout << "consumer ok " << model->parameters().size() << std::endl;
  return 0;
}
CPP
cmake -S "$work/consumer" -B "$work/consumer/build" -G Ninja -DCMAKE_PREFIX_PATH="$work/prefix" > "$work/cfg.log" 2>&1 \
  || { cat "$work/cfg.log"; echo "FAIL: find_package(fsdp) failed"; exit 1; }
cmake --build "$work/consumer/build" > "$work/build.log" 2>&1 || { tail -30 "$work/build.log"; echo "FAIL: consumer build"; exit 1; }
out=$(STORE="$work/store" "$work/consumer/build/consumer")
echo "$out"
[[ "$out" == *"consumer ok 2"* ]] || { echo "FAIL: consumer output: $out"; exit 1; }
echo "1 passed, 0 failed"
