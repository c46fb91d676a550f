#!/usr/bin/env bash
# Every examples/<name>/ project, as examples/README.md promises: built against the installed
# package (find_package(fsdp) from a temp prefix), started with no arguments it runs on 2 ranks
# and prints JSON-lines losses that fall; stopped at a checkpoint and started again with
# --resume auto, it prints the same losses and final eval, bit for bit, as the run that was
# never stopped (and the stopped run's losses equal that run's first steps).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/lib/installed_package.sh"
# shellcheck source=lib/python.sh
source "$here/lib/python.sh"
examples_dir=${FSDP_SOURCE_DIR:-$(cd "$here/../.." && pwd)}/examples
work=$(mktemp -d /tmp/fsdp-examples-XXXXXX)
trap 'rm -rf "$work"' EXIT

fsdp_install "$work/prefix"
# Started bare, an example re-executes itself under fsdp-run from PATH: the installed one.
export PATH="$work/prefix/bin:$PATH"

# Rank 0's stdout lines that hold a JSON object, without fsdp-run's "[rank0]: " prefix.
json_lines() { sed -n 's/^\[rank0\]: \({.*}\)$/\1/p' "$1"; }
# Runs the example in its own directory; on failure shows its output and fails the test.
run() {
  local out=$1; shift
  ( cd "$rundir" && "$exe" "$@" ) > "$rundir/$out.out" 2> "$rundir/$out.err" \
    || { tail -20 "$rundir/$out.out" "$rundir/$out.err"; echo "FAIL: $name $* exited non-zero"; return 1; }
  json_lines "$rundir/$out.out" > "$rundir/$out.jsonl"
}

passed=0
for dir in "$examples_dir"/*/; do
  name=$(basename "$dir")
  [[ -f "$dir/CMakeLists.txt" ]] || continue
  t0=$SECONDS
  fsdp_build_consumer "$dir" "$work/$name/build" "$work/prefix"
  exe="$work/$name/build/$name"
  rundir="$work/$name/run"
  mkdir -p "$rundir"
  built=$((SECONDS - t0))

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
  echo "ok: $name ($steps steps; resumed after step $k equals the uninterrupted run; build ${built}s, runs $((SECONDS - t0 - built))s)"
  passed=$((passed + 1))
done
[[ $passed -ge 1 ]] || { echo "FAIL: no example projects under $examples_dir"; exit 1; }
echo "$passed passed, 0 failed"
