#!/usr/bin/env bash
# fsdp-train --device cuda (label gpu; where torch sees no GPU, "SKIP" and exit 77, or a failure
# under CI=true or FSDP_REQUIRE_GPU=1: lib/skip.sh): 20 mlp steps on the GPU give the losses of
# the same run on the CPU within 1e-4 relative (fp32; cuBLAS and NCCL / Gloo on CUDA sum in other
# orders than the CPU), at 1 rank (NCCL) and at 2 ranks sharing the GPU (Gloo on CUDA),
# full_shard and zero2; a checkpoint saved on the GPU resumes on the CPU, and one saved on the
# CPU resumes on the GPU, continuing within the same bound.
set -euo pipefail
# shellcheck source=lib/fsdp_train_test.sh
source "$(dirname "$0")/lib/fsdp_train_test.sh"
"$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null ||
  skip_test "no CUDA device visible to $PY's torch (torch.cuda.is_available() is false)"

# Losses of a metrics file, one per line.
losses() {
  "$PY" -c 'import json, sys
for l in open(sys.argv[1]):
    j = json.loads(l)
    if "eval" not in j: print(repr(j["loss"]))' "$1"
}
# near A B: every line of A within 1e-4 relative of B's.
near() {
  "$PY" - "$1" "$2" <<'PY' || fail "$3: $(paste -d' ' "$1" "$2" | head -n 3)"
import sys
a = [float(x) for x in open(sys.argv[1])]
b = [float(x) for x in open(sys.argv[2])]
assert len(a) == len(b) and a, (len(a), len(b))
worst = max(abs(x - y) / abs(y) for x, y in zip(a, b))
assert worst <= 1e-4, f"relative difference {worst}"
print(f"{worst:.2e}")
PY
}

for nproc in 1 2; do
  for strategy in full_shard zero2; do
    tag="$strategy-n$nproc"
    for device in cpu cuda; do
      run --device "$device" --nproc "$nproc" --strategy "$strategy" --steps 20 --no-shuffle \
        --metrics "$WORK/$tag-$device.jsonl"
      [[ $RC == 0 ]] || fail "$tag --device $device: exit $RC"
      losses "$WORK/$tag-$device.jsonl" >"$WORK/$tag-$device.losses"
    done
    worst=$(near "$WORK/$tag-cuda.losses" "$WORK/$tag-cpu.losses" "$tag: cuda against cpu")
    pass "$tag: 20 losses on the GPU within $worst relative of the CPU's"
  done
done

# Checkpoints across devices (full_shard, 2 ranks): step-10 of one device's run, resumed on
# the other, continues that run.
for pair in "cuda cpu" "cpu cuda"; do
  read -r from to <<<"$pair"
  CK="$WORK/ck-$from"
  run --device "$from" --steps 20 --no-shuffle --checkpoint-dir "$CK" --checkpoint-every 10 --keep-checkpoints 0 \
    --metrics "$WORK/full-$from.jsonl"
  [[ $RC == 0 ]] || fail "--device $from with checkpoints: exit $RC"
  run --device "$to" --steps 20 --no-shuffle --resume "$CK/step-10" --metrics "$WORK/resumed-$to.jsonl"
  [[ $RC == 0 ]] || fail "--device $to --resume (saved on $from): exit $RC"
  losses "$WORK/full-$from.jsonl" | tail -n 10 >"$WORK/full-$from.tail"
  losses "$WORK/resumed-$to.jsonl" >"$WORK/resumed-$to.losses"
  worst=$(near "$WORK/resumed-$to.losses" "$WORK/full-$from.tail" "saved on $from, resumed on $to")
  pass "saved on $from at step 10, resumed on $to: 10 losses within $worst relative"
done
