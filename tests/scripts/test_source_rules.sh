#!/usr/bin/env bash
# shellcheck disable=SC2317  # the finders are called through rule and planted
# Rules of the sources that the compiler cannot check.
#  1. zero_grad states what it does. libtorch 2.x's Optimizer::zero_grad() sets gradients to
#     none by default where 1.13's zeroed them in place (Python's default changed the same
#     way), so a bare zero_grad() would silently change meaning with the version: every call
#     in C++ code and in our Python passes set_to_none explicitly. Comments are not code.
#  2. Every collective goes through one function: only src/comm/collective_call.cpp calls a
#     transport's collectives ([Note: the collective choke point] in src/comm/collective_call.h).
#  3. End-of-backward callbacks land on the outermost backward: only src/autograd calls the
#     engine's queue_callback; everything else calls fsdp::autograd::queue_end_of_backward
#     ([Note: nested backward] in include/fsdp/autograd/end_of_backward.h).
#  4. A test skips for want of a GPU only through FSDP_SKIP_WITHOUT_GPU (tests/harness/gpu.h),
#     the one skip after which a test binary may report "skipped" ([Note: skips] in
#     tests/harness/skips.h): no GTEST_SKIP on the line of, or the line after, a CUDA query.
#  5. The library reads in sittings: no file under src/ over 600 lines, no function over 80
#     (scripts/check_sizes.py).
set -euo pipefail
SRC="${FSDP_SOURCE_DIR:?set FSDP_SOURCE_DIR to the source tree}"
cd "$SRC"
status=0
plant="$(mktemp -d "$SRC/tests/.plant.XXXXXX")"
trap 'rm -rf "$plant"' EXIT

# rule FINDER "DIR..." BROKEN KEPT: FINDER over the DIRs finds nothing (else BROKEN, the lines).
rule() {
  local found dirs
  read -r -a dirs <<<"$2"
  found="$("$1" "${dirs[@]}")"
  if [[ -n "$found" ]]; then
    echo "FAIL: $3:"
    echo "$found"
    status=1
  else
    echo "ok: $4"
  fi
}
# The rule's own check: planted FINDER FILE COUNT WHAT: FINDER finds COUNT lines of FILE, planted.
planted() {
  if [[ "$("$1" "$plant" | grep -c "$2")" == "$3" ]]; then
    echo "ok: $4 is found"
  else
    echo "FAIL: the check does not find $4"
    status=1
  fi
}

bare_zero_grad() {  # DIR...
  # C++: code before any // comment, and not a /// or * doc line; Python: code before any #.
  grep -rnE --include='*.cpp' --include='*.h' 'zero_grad\(\)' "$@" |
    grep -vE '^[^:]+:[0-9]+:\s*(//|\*)' | grep -vE '//.*zero_grad\(\)' || true
  grep -rnE --include='*.py' 'zero_grad\(\)' "$@" | grep -vE '^[^:]+:[0-9]+:\s*#' || true
}
rule bare_zero_grad "src include tools tests bench examples" \
  "zero_grad() without set_to_none (say zero_grad(/*set_to_none=*/true|false), Python zero_grad(set_to_none=...))" \
  "every zero_grad call says set_to_none"
printf 'void f(torch::optim::Optimizer& o) { o.zero_grad(); }\n' >"$plant/planted_zero_grad.cpp"
printf 'opt.zero_grad()  # planted\n' >"$plant/planted_zero_grad.py"
planted bare_zero_grad planted_zero_grad 2 "a planted bare zero_grad() call (C++ and Python)"

transport_calls() {  # DIR...
  grep -rnE --include='*.cpp' --include='*.h' 'transport\(\)->(all_gather|reduce_scatter|all_reduce|broadcast|barrier)\(|\bt\.(all_gather|reduce_scatter|all_reduce|broadcast|barrier)\(g,' "$@" |
    grep -v '^src/comm/collective_call.cpp:' || true
}
rule transport_calls "src include tools" \
  "a transport's collective called outside src/comm/collective_call.cpp (go through comm::detail::issue)" \
  "every collective is issued by src/comm/collective_call.cpp"
printf 'void f(const ProcessGroup& g) { g.transport()->all_reduce(g, t, op); }\n' >"$plant/planted_transport.cpp"
planted transport_calls planted_transport 1 "a planted direct transport call"

queue_callbacks() {  # DIR...
  grep -rnE --include='*.cpp' --include='*.h' 'queue_callback\(' "$@" |
    grep -vE '^[^:]+:[0-9]+:\s*(//|\*)' | grep -v '^src/autograd/' || true
}
rule queue_callbacks "src include tools" \
  "Engine::queue_callback called outside src/autograd (call fsdp::autograd::queue_end_of_backward)" \
  "only src/autograd queues engine callbacks"
printf 'void f() { torch::autograd::Engine::get_default_engine().queue_callback([] {}); }\n' >"$plant/planted_callback.cpp"
planted queue_callbacks planted_callback 1 "a planted queue_callback call"

gpu_skips() {  # DIR...
  local f
  for f in $(grep -rlE --include='*.cpp' --include='*.h' 'GTEST_SKIP' "$@" | grep -v '^tests/harness/gpu\.' || true); do
    awk -v f="$f" '/cuda::(is_available|device_count)/ { near = 2 }
                   near > 0 && /GTEST_SKIP/ { print f ":" FNR ": " $0 }
                   { near-- }' "$f"
  done
}
rule gpu_skips "tests" \
  "a GPU skip of its own (use FSDP_SKIP_WITHOUT_GPU(devices), tests/harness/gpu.h)" \
  "every GPU skip goes through FSDP_SKIP_WITHOUT_GPU"
printf 'TEST(A, B) {\n  if (!torch::cuda::is_available())\n    GTEST_SKIP() << "no GPU";\n}\n' >"$plant/planted_skip.cpp"
planted gpu_skips planted_skip 1 "a planted GPU skip of its own"

long_code() {  # DIR...
  python3 scripts/check_sizes.py "$@"
}
rule long_code "src" \
  "library code too long to read (cut the function into named phases, the file along its concepts)" \
  "no library file over 600 lines, no function over 80"
{
  echo "int planted_long() {"
  for i in $(seq 1 85); do echo "  int v$i = $i;"; done
  echo "  return 0;"
  echo "}"
  for i in $(seq 1 520); do echo "// line $i"; done
} >"$plant/planted_long.cpp"
planted long_code planted_long 2 "a planted 88-line function in a 611-line file"

((status == 0)) && echo "PASS: test_source_rules"
exit "$status"
