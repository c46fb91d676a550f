#!/usr/bin/env bash
# The installed package's consumers: the build tree installed into a temp prefix (cmake --install),
# then projects built against it alone (find_package(fsdp) seeing only that prefix):
#  1. a minimal consumer: it builds, links and runs a one-rank FSDP step, and the fsdp-run that
#     Trainer::fit would re-execute it under is the installed one (the exported targets tell a
#     program compiled against the package where it was installed);
#  2. every examples/<name>/ project, as examples/README.md promises: started with no arguments
#     it runs on 2 ranks and prints JSON-lines losses that fall; stopped at a checkpoint and
#     started again with --resume auto, it prints the same losses and final eval, bit for bit,
#     as the run that was never stopped (and the stopped run's losses equal that run's first
#     steps); started in a wrong launch environment, it reports the library's error in one
#     message and exits non-zero (lib/wrong_launch_env.sh).
# Configuring each project prints no CMake warning but those of torch's own CMake files
# (fsdp_build_consumer; docs/usage.md says why those are harmless).
# The projects are configured and built at the same time (each is one translation unit, so a
# build alone keeps one core busy), then run one after another.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/lib/installed_package.sh"
# shellcheck source=lib/python.sh
source "$here/lib/python.sh"
source "$here/lib/wrong_launch_env.sh"
examples_dir=${FSDP_SOURCE_DIR:-$(cd "$here/../.." && pwd)}/examples
work=$(mktemp -d /tmp/fsdp-examples-XXXXXX)
trap 'rm -rf "$work"' EXIT

fsdp_install "$work/prefix"
# Started bare, an example re-executes itself under fsdp-run from PATH: the installed one.
export PATH="$work/prefix/bin:$PATH"

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

# Every project's build, all at once: build/<name> for the consumer and each example.
names=(consumer)
sources=("$work/consumer")
for dir in "$examples_dir"/*/; do
  [[ -f "$dir/CMakeLists.txt" ]] || continue
  names+=("$(basename "$dir")")
  sources+=("$dir")
done
((${#names[@]} >= 2)) || { echo "FAIL: no example projects under $examples_dir"; exit 1; }
t0=$SECONDS
pids=()
for i in "${!names[@]}"; do
  fsdp_build_consumer "${sources[$i]}" "$work/build/${names[$i]}" "$work/prefix" > "$work/build.${names[$i]}.out" 2>&1 &
  pids+=($!)
done
failed=0
for i in "${!names[@]}"; do
  wait "${pids[$i]}" || { cat "$work/build.${names[$i]}.out"; failed=1; }
done
((failed == 0)) || exit 1
echo "ok: built ${names[*]} against the installed package in $((SECONDS - t0))s (at the same time)"
echo "ok: configuring them printed no CMake warning but torch's own, which were:"
fsdp_torch_warnings "$work/build/consumer/configure.log" | sed 's/^/  /'

# 1. The minimal consumer.
out=$(STORE="$work/store" "$work/build/consumer/consumer")
echo "$out"
[[ "$out" == *"consumer ok 2"* ]] || { echo "FAIL: consumer output: $out"; exit 1; }
[[ "$out" == *"launcher $work/prefix/bin/fsdp-run"* ]] ||
  { echo "FAIL: a program built against $work/prefix would not use its fsdp-run: $out"; exit 1; }
echo "ok: consumer (one FSDP step; the installed fsdp-run is its launcher)"
passed=1

# Rank 0's stdout lines that hold a JSON object, without fsdp-run's "[rank0]: " prefix.
json_lines() { sed -n 's/^\[rank0\]: \({.*}\)$/\1/p' "$1"; }
# Runs the example in its own directory; on failure shows its output and fails the test.
run() {
  local out=$1; shift
  ( cd "$rundir" && "$exe" "$@" ) > "$rundir/$out.out" 2> "$rundir/$out.err" \
    || { tail -20 "$rundir/$out.out" "$rundir/$out.err"; echo "FAIL: $name $* exited non-zero"; return 1; }
  json_lines "$rundir/$out.out" > "$rundir/$out.jsonl"
}

# 2. The examples.
for name in "${names[@]:1}"; do
  t0=$SECONDS
  exe="$work/build/$name/$name"
  rundir="$work/$name/run"
  mkdir -p "$rundir"

  # 1. No arguments: 2 ranks (through fsdp-run: the "[rankN]: " prefixes), losses fall.
  run full
  grep -q '^\[rank0\]: .* 2 ranks' "$rundir/full.err" \
    || { cat "$rundir/full.err"; echo "FAIL: $name with no arguments did not report 2 ranks on stderr"; exit 1; }
  "$PY" "$here/lib/losses_fall.py" "$rundir/full.jsonl"
  steps=$("$PY" -c 'import json,sys; print(max(j["step"] for j in map(json.loads, open(sys.argv[1])) if "loss" in j))' "$rundir/full.jsonl")

  # 2. Stop at step K (not a multiple of anything the example might align to), resume to the end.
  k=$((steps / 2 + 3))
  run first --steps "$k" --checkpoint-dir ckpt
  run resumed --steps "$steps" --checkpoint-dir ckpt --resume auto
  "$PY" - "$rundir/full.jsonl" "$rundir/first.jsonl" "$k" <<'PY'
import json, sys
full = {j["step"]: j["loss"] for j in map(json.loads, open(sys.argv[1])) if "loss" in j}
first = {j["step"]: j["loss"] for j in map(json.loads, open(sys.argv[2])) if "loss" in j}
k = int(sys.argv[3])
assert sorted(first) == list(range(1, k + 1)), f"the stopped run wrote steps {sorted(first)[:2]}..., expected 1..{k}"
bad = [f"step {s}: {first[s]!r} vs {full[s]!r}" for s in first if first[s] != full[s]]
assert not bad, "the stopped run's losses differ from the full run's: " + "; ".join(bad[:3])
PY
  "$PY" "$here/lib/resumed_losses.py" "$rundir/full.jsonl" "$rundir/resumed.jsonl" "$k" "$steps" \
    || { echo "FAIL: $name resumed at step $k does not continue the uninterrupted run"; exit 1; }

  # 3. A wrong launch environment: the library's message, no backtrace, a non-zero exit.
  ( cd "$rundir" && reports_wrong_env "$rundir/wrong_env.out" "$exe" ) || exit 1
  echo "ok: $name ($steps steps; resumed after step $k equals the uninterrupted run; a wrong launch" \
    "environment reported in one message; runs $((SECONDS - t0))s)"
  passed=$((passed + 1))
done
echo "$passed passed, 0 failed"
