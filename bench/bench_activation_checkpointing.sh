#!/usr/bin/env bash
# Activation checkpointing in fsdp-train: a 16-block gpt (FULL_SHARD, 2 ranks) with and
# without --activation-checkpointing, runs alternating, REPEAT pairs. Per run:
#   activation peak  the largest "other" of rank 0's memory trace (fsdp::MemoryTracer: what
#                    the counting CPU allocator holds beyond parameters, gradients and
#                    optimizer state, sampled at every unit boundary) from step 2 on
#   step             the median seconds per step of steps 3 and later (the metrics file)
#   cpu              CPU seconds (user + system) of the whole run, every rank: on a host shared
#                    with other work, wall time follows the neighbours' load, CPU time much less
#                    (start-up and the final evaluation are in it, the same in both runs)
# and the ratios of each pair, measured in the same pair. The batch is chosen so that
# activations dominate the memory.
#
#   bench/bench_activation_checkpointing.sh [build/bin] [--repeat 2] [--steps 10]
#       [--layers 16 --dim 128 --heads 4 --context 256 --batch-size 16 --nproc 2]
set -euo pipefail
BIN="${1:-build/bin}"
shift || true
REPEAT=2 STEPS=10 LAYERS=16 DIM=128 HEADS=4 CONTEXT=256 BATCH=16 NPROC=2
while [[ $# -gt 0 ]]; do
  case "$1" in
    --repeat) REPEAT="$2"; shift 2 ;;
    --steps) STEPS="$2"; shift 2 ;;
    --layers) LAYERS="$2"; shift 2 ;;
    --dim) DIM="$2"; shift 2 ;;
    --heads) HEADS="$2"; shift 2 ;;
    --context) CONTEXT="$2"; shift 2 ;;
    --batch-size) BATCH="$2"; shift 2 ;;
    --nproc) NPROC="$2"; shift 2 ;;
    -h|--help) sed -n 2,13p "$0"; exit 0 ;;
    *) echo "bench_activation_checkpointing.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
TRAIN="$BIN/fsdp-train"
[[ -x "$TRAIN" ]] || { echo "bench_activation_checkpointing.sh: build fsdp-train into $BIN" >&2; exit 1; }
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

run() {  # NAME [FLAG]
  /usr/bin/time -f "%U %S" -o "$WORK/$1.cpu" "$TRAIN" --model gpt --layers "$LAYERS" --dim "$DIM" --heads "$HEADS" --context "$CONTEXT" \
    --batch-size "$BATCH" --steps "$STEPS" --nproc "$NPROC" --log-every 1000 --eval-every 0 \
    --memory-trace "$WORK/$1.mem" --metrics "$WORK/$1.metrics" "${@:2}" >"$WORK/$1.log" 2>&1 ||
    { cat "$WORK/$1.log" >&2; exit 1; }
}

for r in $(seq 1 "$REPEAT"); do
  run "plain$r"
  run "ckpt$r" --activation-checkpointing
done

python3 - "$WORK" "$REPEAT" <<'PY'
import json, statistics, sys
work, repeat = sys.argv[1], int(sys.argv[2])
def measure(name):
    mem = [json.loads(l) for l in open(f"{work}/{name}.mem")]
    peak = max(s["bytes"]["other"] for s in mem if s["step"] >= 1)
    steps = [json.loads(l) for l in open(f"{work}/{name}.metrics")]
    secs = [m["samples"] / m["samples_per_s"] for m in steps if "samples_per_s" in m and m["step"] >= 3]
    cpu = sum(float(x) for x in open(f"{work}/{name}.cpu").read().split()[-2:])
    return peak, statistics.median(secs), cpu
print("| pair | activation peak plain | checkpointed | ratio | step plain | checkpointed | ratio | cpu plain | checkpointed | ratio |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for r in range(1, repeat + 1):
    (pp, sp, cp), (pc, sc, cc) = measure(f"plain{r}"), measure(f"ckpt{r}")
    print(f"| {r} | {pp / 2**20:.1f} MiB | {pc / 2**20:.1f} MiB | {pc / pp:.3f} | {sp:.3f} s | {sc:.3f} s | {sc / sp:.2f}x "
          f"| {cp:.1f} s | {cc:.1f} s | {cc / cp:.2f}x |")
PY
