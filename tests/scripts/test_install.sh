#!/usr/bin/env bash
# `cmake --install` then `find_package(fsdp)` from a separate consumer project:
# the consumer builds, links and runs a one-rank FSDP step, and the fsdp-run that
# Trainer::fit would re-execute it under is the installed one (the exported targets tell a
# program compiled against the package where it was installed).
set -euo pipefail
source "$(dirname "$0")/lib/installed_package.sh"
work=$(mktemp -d /tmp/fsdp-install-XXXXXX)
trap 'rm -rf "$work"' EXIT

fsdp_install "$work/prefix"

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
#include "fsdp/comm/process_group.h"
#include "fsdp/core/fully_sharded.h"
#include "fsdp/trainer/trainer.h"
int main() {
  auto pg = fsdp::comm::init_process_group(
      fsdp::comm::InitOptions().file_store_path(std::string(std::getenv("STORE"))).overrides([] {
        fsdp::comm::LaunchOverrides o; o.rank = 0; o.world_size = 1; return o; }()));
  torch::manual_seed(0);
  auto model = fsdp::FullyShardedDataParallel(torch::nn::Sequential(torch::nn::Linear(4, 3)), pg);
  torch::optim::SGD opt(model->parameters(), 0.1);
  auto loss = model->forward(torch::ones({2, 4})).sum();
  loss.backward();
  opt.step();
  std::cout << "consumer ok " << model->parameters().size() << std::endl;
  std::cout << "launcher " << fsdp::trainer::find_launcher("", fsdp::trainer::detail::installed_bindir()) << std::endl;
  return 0;
}
CPP
fsdp_build_consumer "$work/consumer" "$work/consumer/build" "$work/prefix"
out=$(STORE="$work/store" "$work/consumer/build/consumer")
echo "$out"
[[ "$out" == *"consumer ok 2"* ]] || { echo "FAIL: consumer output: $out"; exit 1; }
[[ "$out" == *"launcher $work/prefix/bin/fsdp-run"* ]] ||
  { echo "FAIL: a program built against $work/prefix would not use its fsdp-run: $out"; exit 1; }
echo "1 passed, 0 failed"
