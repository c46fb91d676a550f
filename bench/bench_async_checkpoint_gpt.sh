#!/usr/bin/env bash
# Asynchronous checkpoints in fsdp-train: its gpt at ~150M parameters (12 blocks of width 1024),
# FULL_SHARD, Adam, 4 ranks, in rounds of three runs in rotating order:
#   none      no checkpoints
#   async     --checkpoint-dir, saves every 10 steps (fsdp-train's default: asynchronous)
#   blocking  the same with --no-async-checkpoint (training waits for each save: its snapshot
#             and its write)
# Per run: the mean seconds per step of steps 3 and later (the metrics file: samples /
# samples_per_s; a save's cost lands in the steps after it), the blocked seconds per save of
# the saves at steps 10 and 20 (the metrics' "checkpoint": the save call plus copy-on-write
# faults; a blocking save's whole time), and the CPU seconds of the whole run, every rank.
# Reported: blocked per async save / blocking save (goal <= 0.02), step time with and without
# saves, and the step overhead the saves' CPU predicts on these cores: the async run's extra
# CPU over the none run, spread over its cores and its steps (on 2 busy cores a save's CPU
# cannot hide behind training; on a GPU host it can).
#
#   bench/bench_async_checkpoint_gpt.sh [build/bin] [--rounds 2] [--steps 30] [--every 10]
#       [--layers 12 --dim 1024 --heads 16 --context 32 --batch-size 4 --nproc 4] [--dir /tmp]
set -euo pipefail
BIN="${1:-build/bin}"
shift || true
ROUNDS=2 STEPS=30 EVERY=10 LAYERS=12 DIM=1024 HEADS=16 CONTEXT=32 BATCH=4 NPROC=4 DIR=/tmp
while [[ $# -gt 0 ]]; do
  case "$1" in
    --rounds) ROUNDS="$2"; shift 2 ;;
    --steps) STEPS="$2"; shift 2 ;;
    --every) EVERY="$2"; shift 2 ;;
    --layers) LAYERS="$2"; shift 2 ;;
    --dim) DIM="$2"; shift 2 ;;
    --heads) HEADS="$2"; shift 2 ;;
    --context) CONTEXT="$2"; shift 2 ;;
    --batch-size) BATCH="$2"; shift 2 ;;
    --nproc) NPROC="$2"; shift 2 ;;
    --dir) DIR="$2"; shift 2 ;;
    -h|--help) sed -n 2,18p "$0"; exit 0 ;;
    *) echo "bench_async_checkpoint_gpt.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
TRAIN="$BIN/fsdp-train"
[[ -x "$TRAIN" ]] || { echo "bench_async_checkpoint_gpt.sh: build fsdp-train into $BIN" >&2; exit 1; }
WORK="$(mktemp -d "$DIR/bench_async_gpt.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

run() {  # NAME [FLAGS...]
  rm -rf "$WORK/ckpt"
  /usr/bin/time -f "%U %S" -o "$WORK/$1.cpu" "$TRAIN" --model gpt --layers "$LAYERS" --dim "$DIM" --heads "$HEADS" \
    --context "$CONTEXT" --batch-size "$BATCH" --steps "$STEPS" --nproc "$NPROC" --log-every 1000 --eval-every 0 \
    --metrics "$WORK/$1.metrics" "${@:2}" >"$WORK/$1.log" 2>&1 || { cat "$WORK/$1.log" >&2; exit 1; }
}

for r in $(seq 1 "$ROUNDS"); do
  order=(none async blocking)
  for i in 0 1 2; do
    kind=${order[$(( (i + r - 1) % 3 ))]}
    case "$kind" in
      none) run "none$r" ;;
      async) run "async$r" --checkpoint-dir "$WORK/ckpt" --checkpoint-every "$EVERY" ;;
      blocking) run "blocking$r" --checkpoint-dir "$WORK/ckpt" --checkpoint-every "$EVERY" --no-async-checkpoint ;;
    esac
  done
done

python3 - "$WORK" "$ROUNDS" "$STEPS" "$EVERY" <<'PY'
import json, statistics, sys
work, rounds, steps, every = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
def measure(name, waits=False):
    lines = [json.loads(l) for l in open(f"{work}/{name}.metrics")]
    secs = [m["samples"] / m["samples_per_s"] for m in lines if "samples_per_s" in m and m["step"] >= 3]
    saves = [m["checkpoint"] for m in lines if "checkpoint" in m and 0 < m["checkpoint"]["step"] < steps]
    # A waiting save blocks for its snapshot and its write; an asynchronous one for the call
    # and the copy-on-write faults.
    blocked = [c["blocked_s"] + (c["background_s"] if waits else c.get("cow_fault_s", 0)) for c in saves]
    cpu = sum(float(x) for x in open(f"{work}/{name}.cpu").read().split()[-2:])
    return statistics.mean(secs), blocked, cpu, saves
ratios, print_rows = [], []
print("| round | step none | step async | step blocking | async blocked per save | blocking save | blocked ratio "
      "| async extra CPU per save | predicted step overhead | measured |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for r in range(1, rounds + 1):
    sn, _, cn, _ = measure(f"none{r}")
    sa, ba, ca, saves = measure(f"async{r}")
    sb, bb, cb, _ = measure(f"blocking{r}", waits=True)
    ratio = statistics.median(ba) / statistics.median(bb)
    ratios.append(ratio)
    n_saves = max(len(ba), 1)
    extra = (ca - cn) / n_saves
    cores = 2
    predicted = extra / cores / every
    print(f"| {r} | {sn:.3f} s | {sa:.3f} s | {sb:.3f} s | {statistics.median(ba):.4f} s | {statistics.median(bb):.3f} s "
          f"| {ratio:.4f} | {extra:.2f} s | +{predicted:.3f} s | +{sa - sn:.3f} s |")
    call = statistics.median(c["blocked_s"] for c in saves)
    faults = statistics.median(c.get("cow_fault_s", 0) for c in saves)
    pages = statistics.median(c.get("cow_pages_copied", 0) for c in saves)
    print_rows.append(f"round {r}: async save call {call:.4f} s, copy-on-write faults {faults:.4f} s "
                      f"({pages:.0f} pages copied), writer {statistics.median(c['background_s'] for c in saves):.2f} s "
                      "(rank 0, medians over the saves)")
for row in print_rows:
    print(row)
gb = saves[0]["bytes"] / 1e9 if saves else 0
print(f"blocked per async save / blocking save: median {statistics.median(ratios):.4f} "
      f"({min(ratios):.4f}-{max(ratios):.4f}), {rounds} rounds; goal <= 0.02; {gb:.2f} GB per save")
PY
