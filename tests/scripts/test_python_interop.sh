#!/usr/bin/env bash
# Full state dicts between the library and Python PyTorch (the torch wheel the build
# links, under $FSDP_PYTHON), both ways: C++ save -> Python torch.load + strict
# load_state_dict into the equivalent torch.nn model (same outputs); Python
# torch.save(state_dict) -> C++ load_state_dict, and -> rank 0's map_full_state_dict +
# load_state_dict_from_rank0 at 2 ranks (same outputs).
# Every torch.load here is the default one, weights_only=True since torch 2.6: what the
# library writes must load without trusting the file, so its pickles carry no TorchScript
# globals (torch.jit._pickle.restore_type_tag, which torch::pickle_save writes for a dict,
# or build_intlist and the other specialised lists), only what torch.save itself writes.
set -euo pipefail
BIN=${FSDP_BIN_DIR:?FSDP_BIN_DIR must point at the build bin directory}
# PY (the build's Python), py_has
# shellcheck source=lib/python.sh
source "$(dirname "$0")/lib/python.sh"
# shellcheck source=lib/skip.sh
source "$(dirname "$0")/lib/skip.sh"
# One thread, set before torch loads (the wheel's MKL and OpenMP start one per core): the
# outputs compared here then round as the C++ side's do.
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
py_has torch || skip_test "$PY has no torch ($PY_MISSING)"
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT

MODEL='torch.nn.Sequential(torch.nn.Linear(13,32), torch.nn.ReLU(), torch.nn.Linear(32,17), torch.nn.ReLU(), torch.nn.Linear(17,5))'

# 1. C++ -> Python
"$BIN/state_dict_interop" save "$T/cpp_model.pt" "$T/cpp_out.pt"
"$PY" - "$T" <<PYEOF
import sys, torch
torch.set_num_threads(1)
t = sys.argv[1]
sd = torch.load(t + "/cpp_model.pt")
assert type(sd) is dict, type(sd)
assert all(isinstance(v, torch.Tensor) for v in sd.values())
m = $MODEL
m.load_state_dict(sd, strict=True)
x = torch.linspace(-1, 1, 4 * 13).reshape(4, 13)
expected = torch.load(t + "/cpp_out.pt")
d = (m(x) - expected).abs().max().item()
print("C++ -> Python: keys", sorted(sd.keys()), "max diff", d)
assert d < 1e-5, d
PYEOF

# 2. Python -> C++
"$PY" - "$T" <<PYEOF
import sys, torch
torch.set_num_threads(1)
t = sys.argv[1]
torch.manual_seed(7)
m = $MODEL
torch.save(dict(m.state_dict()), t + "/py_model.pt")  # a plain dict
x = torch.linspace(-1, 1, 4 * 13).reshape(4, 13)
with torch.no_grad():
    torch.save(m(x), t + "/py_out.pt")
PYEOF
"$BIN/state_dict_interop" load "$T/py_model.pt" "$T/py_out.pt"
# The same file, mapped by rank 0 only and streamed unit by unit into 2 ranks' shards.
"$BIN/fsdp-run" --nproc 2 -- "$BIN/state_dict_interop" load-rank0 "$T/py_model.pt" "$T/py_out.pt"

# 3. The check can fail: Python's output against a differently initialised C++ model.
if "$BIN/state_dict_interop" load "$T/cpp_model.pt" "$T/py_out.pt" >/dev/null; then
  echo "FAIL: a mismatched model passed the output check"; exit 1
fi
# 4. fsdp-ckpt: a 3-rank checkpoint, inspected and consolidated; Python reads the
# consolidated file as the same plain dict as the FULL state dict.
"$BIN/fsdp-run" --nproc 3 -- "$BIN/state_dict_interop" checkpoint "$T/ckpt" "$T/full.pt" >/dev/null
"$BIN/fsdp-ckpt" inspect "$T/ckpt" > "$T/inspect.txt"
cat "$T/inspect.txt"
grep -q "world size 3" "$T/inspect.txt"
grep -q "param 2.weight \[17, 32\] float32 2176 B (+" "$T/inspect.txt"
[ "$(grep -c 'checksum ok' "$T/inspect.txt")" = 3 ]
"$BIN/fsdp-ckpt" consolidate "$T/ckpt" "$T/consolidated.pt"
"$PY" - "$T" <<PYEOF
import sys, torch
torch.set_num_threads(1)
t = sys.argv[1]
c = torch.load(t + "/consolidated.pt")
f = torch.load(t + "/full.pt")
assert type(c) is dict, type(c)
assert list(c.keys()) == list(f.keys()), (list(c.keys()), list(f.keys()))
for k in f:
    assert torch.equal(c[k], f[k]), k
m = $MODEL
m.load_state_dict(c, strict=True)
print("consolidated == FULL state dict:", list(c.keys()))
o = torch.load(t + "/full.pt.optim")
assert type(o) is dict and set(o) == {"state", "param_groups"}, o.keys()
assert o["state"]["0.weight"]["exp_avg"].shape == (32, 13)
assert int(o["state"]["0.weight"]["step"]) == 1
assert abs(o["param_groups"][0]["lr"] - 1e-2) < 1e-12
assert o["param_groups"][0]["params"] == list(f.keys()), o["param_groups"]
print("optimizer state dict: plain dict, state keys", sorted(o["state"].keys()))
PYEOF
# 5. Tied weights (embed.weight is head.weight, one FSDP unit): the consolidated
# file and the FULL state dict carry both names; a Python module with the same
# tie loads the consolidated file strictly and gives the C++ model's output.
"$BIN/fsdp-run" --nproc 2 -- "$BIN/state_dict_interop" tied "$T/tied" "$T/tied_full.pt" >/dev/null
"$BIN/fsdp-ckpt" consolidate "$T/tied" "$T/tied_consolidated.pt"
"$PY" - "$T" <<PYEOF
import sys, torch
torch.set_num_threads(1)
t = sys.argv[1]
class Holder(torch.nn.Module):
    def __init__(self, w):
        super().__init__()
        self.weight = w
class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        w = torch.nn.Parameter(torch.zeros(11, 6))
        self.embed, self.mid, self.head = Holder(w), torch.nn.Linear(6, 6), Holder(w)
    def forward(self, x):
        return torch.tanh(self.mid(x @ self.embed.weight)) @ self.head.weight.t()
for name in ("tied_consolidated.pt", "tied_full.pt"):
    sd = torch.load(t + "/" + name)
    assert set(sd) == {"embed.weight", "mid.weight", "mid.bias", "head.weight"}, (name, list(sd))
    assert torch.equal(sd["embed.weight"], sd["head.weight"]), name
    m = Tied()
    m.load_state_dict(sd, strict=True)
    assert m.embed.weight is m.head.weight
    x = torch.linspace(-1, 1, 4 * 11).reshape(4, 11)
    d = (m(x) - torch.load(t + "/tied_full.pt.out")).abs().max().item()
    print("tied:", name, "keys", sorted(sd), "max diff", d)
    assert d < 1e-5, d
PYEOF
# A flipped byte is reported by inspect (exit 1) with the file's name.
printf '\xff' | dd of="$T/ckpt/shard_rank00001.bin" bs=1 seek=10 conv=notrunc 2>/dev/null
if "$BIN/fsdp-ckpt" inspect "$T/ckpt" > "$T/inspect2.txt"; then echo "FAIL: inspect missed a flipped byte"; exit 1; fi
grep -q "shard_rank00001.bin .*CHECKSUM MISMATCH" "$T/inspect2.txt"
echo "PASS"
