#!/usr/bin/env bash
# safetensors between fsdp-train and Python's reference reader and writer (Hugging Face's
# safetensors package, installed by scripts/bootstrap.sh), both ways, at different world sizes:
#  1. fsdp-train (3 ranks, full_shard) exports its initial gpt; Python's load_file reads every
#     tensor with the model's names, shapes and dtype.
#  2. Python writes other weights (seeded) as a sharded set with its index, and as one bf16
#     file; fsdp-train (2 ranks, shard_grad_op) loads each and exports it again without
#     training: the values Python reads back equal what it wrote (bf16: widened exactly), and
#     the export in 2-file shards is an index Python's files and json read.
#  3. The weights take effect: a run started from Python's file evaluates to the same loss as
#     the run whose weights they are, and trains on from them.
set -euo pipefail
BIN=${FSDP_BIN_DIR:?FSDP_BIN_DIR must point at the build bin directory}
# shellcheck source=lib/python.sh
source "$(dirname "$0")/lib/python.sh"
# shellcheck source=lib/skip.sh
source "$(dirname "$0")/lib/skip.sh"
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
py_has torch || skip_test "$PY has no torch ($PY_MISSING)"
py_has safetensors || skip_test "$PY has no safetensors (run scripts/bootstrap.sh, which installs it)"
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
TRAIN=("$BIN/fsdp-train" --model gpt --batch-size 12 --threads 1)
eval_loss() { sed -n 's/.*eval @ step 0: validation next-byte loss \([0-9.]*\).*/\1/p' "$1" | head -1; }

# 1. fsdp-train -> Python.
"${TRAIN[@]}" --nproc 3 --seed 7 --steps 0 --export-safetensors "$T/seed7" > "$T/seed7.log" 2>&1
"$PY" - "$T" <<'PYEOF'
import sys
from safetensors import safe_open
from safetensors.torch import load_file
t = sys.argv[1]
sd = load_file(t + "/seed7/model.safetensors")
assert len(sd) == 37, sorted(sd)
assert sd["tok.weight"].shape == (256, 64) and sd["block0.attn.q.weight"].shape == (64, 64), sd["tok.weight"].shape
assert all(str(v.dtype) == "torch.float32" for v in sd.values())
with safe_open(t + "/seed7/model.safetensors", "pt") as f:
    assert f.metadata() == {"format": "pt"}, f.metadata()
print("fsdp-train -> Python: 37 tensors, float32")
PYEOF

# 2. Python -> fsdp-train -> Python.
"$PY" - "$T" <<'PYEOF'
import json, os, sys
import torch
from safetensors.torch import load_file, save_file
t = sys.argv[1]
sd = load_file(t + "/seed7/model.safetensors")
g = torch.Generator().manual_seed(3)
mine = {k: (torch.randn(v.shape, generator=g) * 0.05).contiguous() for k, v in sd.items()}
names = sorted(mine)
os.makedirs(t + "/py_set")
halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
          "model-00002-of-00002.safetensors": names[len(names) // 2 :]}
weight_map = {}
for file, part in halves.items():
    save_file({k: mine[k] for k in part}, t + "/py_set/" + file, metadata={"format": "pt"})
    weight_map.update({k: file for k in part})
total = sum(v.numel() * 4 for v in mine.values())
with open(t + "/py_set/model.safetensors.index.json", "w") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
os.makedirs(t + "/py_bf16")
save_file({k: v.to(torch.bfloat16) for k, v in mine.items()}, t + "/py_bf16/model.safetensors")
torch.save(mine, t + "/mine.pt")
PYEOF
"${TRAIN[@]}" --nproc 2 --strategy shard_grad_op --steps 0 --init-from "$T/py_set/model.safetensors.index.json" \
  --export-safetensors "$T/back" --export-max-shard-bytes 200000 > "$T/back.log" 2>&1
"${TRAIN[@]}" --nproc 3 --steps 0 --init-from "$T/py_bf16" --export-safetensors "$T/back_bf16" > "$T/back_bf16.log" 2>&1
"$PY" - "$T" <<'PYEOF'
import json, sys
import torch
from safetensors.torch import load_file
t = sys.argv[1]
mine = torch.load(t + "/mine.pt")
index = json.load(open(t + "/back/model.safetensors.index.json"))
files = sorted(set(index["weight_map"].values()))
assert len(files) > 1 and files[0].startswith("model-00001-of-"), files
back = {}
for f in files:
    part = load_file(t + "/back/" + f)
    assert all(index["weight_map"][k] == f for k in part), f
    back.update(part)
assert index["metadata"]["total_size"] == sum(v.numel() * 4 for v in back.values())
assert set(back) == set(mine), set(back) ^ set(mine)
for k in mine:
    assert torch.equal(back[k], mine[k]), k
bf16 = load_file(t + "/back_bf16/model.safetensors")
for k in mine:
    assert torch.equal(bf16[k], mine[k].to(torch.bfloat16).float()), k
print("Python -> fsdp-train (2 and 3 ranks) -> Python: equal;", len(files), "files in the exported set")
PYEOF

# 3. The loaded weights are the model's: seed 1 started from seed 7's export evaluates as seed 7
# did, and trains on.
"${TRAIN[@]}" --nproc 2 --seed 1 --steps 0 --init-from "$T/seed7" --export-safetensors "$T/from7" > "$T/from7.log" 2>&1
"${TRAIN[@]}" --nproc 2 --seed 1 --steps 2 --init-from "$T/seed7" > "$T/trained.log" 2>&1
"${TRAIN[@]}" --nproc 2 --seed 1 --steps 0 --export-safetensors "$T/seed1" > "$T/seed1.log" 2>&1
l7=$(eval_loss "$T/seed7.log"); lfrom=$(eval_loss "$T/from7.log"); l1=$(eval_loss "$T/seed1.log")
echo "step-0 validation loss: seed 7 $l7, seed 1 from seed 7's weights $lfrom, seed 1 $l1"
[ -n "$l7" ] && [ "$l7" = "$lfrom" ] || { echo "FAIL: the loaded weights did not take effect"; exit 1; }
[ "$l1" != "$l7" ] || { echo "FAIL: seeds 1 and 7 evaluate alike, so the check above proves nothing"; exit 1; }
grep -q "throughput: .* (2 steps" "$T/trained.log" || { echo "FAIL: no training after --init-from"; cat "$T/trained.log"; exit 1; }

# 4. A file that does not fit the model is refused, naming what is missing.
"$PY" - "$T" <<'PYEOF'
import sys
from safetensors.torch import load_file, save_file
t = sys.argv[1]
sd = load_file(t + "/seed7/model.safetensors")
del sd["ln_f.bias"]
save_file(sd, t + "/short.safetensors")
PYEOF
if "${TRAIN[@]}" --nproc 2 --steps 1 --init-from "$T/short.safetensors" > "$T/short.log" 2>&1; then
  echo "FAIL: a file without ln_f.bias loaded"; exit 1
fi
grep -q "not in the file: 'ln_f.bias'" "$T/short.log" || { cat "$T/short.log"; exit 1; }
if grep -q "frame #" "$T/short.log"; then echo "FAIL: a C++ backtrace"; cat "$T/short.log"; exit 1; fi
echo "PASS"
