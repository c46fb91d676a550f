#!/usr/bin/env bash
# DCP checkpoints between Python's FSDP2 (torchrun, 2 ranks, Gloo on the CPU) and fsdp-cpp
# (tools/examples/dcp_interop.cpp under fsdp-run, 3 ranks: the 13x17 weight splits mid-row),
# both ways, fp32 and bf16:
#  1. FSDP2 trains one Adam step and dcp.saves {"model", "optim"} (FSDP2's uneven dim-0
#     chunks, Adam's step a tensor); fsdp-cpp loads it: values and Adam state equal to FSDP2's
#     bitwise; then both train one more step on the same batch: parameters within 1e-6.
#  2. fsdp-cpp trains one step and save_dcps at 3 ranks; FSDP2 dcp.loads it at 2 ranks into
#     a fresh model and Adam: parameters, moments and step bitwise equal to fsdp-cpp's; and
#     format_utils.dcp_to_torch_save reads it.
set -euo pipefail
BIN=${FSDP_BIN_DIR:?FSDP_BIN_DIR must point at the build bin directory}
# shellcheck source=lib/python.sh
source "$(dirname "$0")/lib/python.sh"
# shellcheck source=lib/skip.sh
source "$(dirname "$0")/lib/skip.sh"
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
py_has torch.distributed.run || skip_test "$PY has no torch.distributed.run ($PY_MISSING)"
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT

cat > "$T/fsdp2.py" <<'PYEOF'
# python fsdp2.py save|load DTYPE DIR OUT: FSDP2 on 2 ranks, the model and batch of dcp_interop.
import os
import sys
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                     get_state_dict, set_state_dict, get_model_state_dict)
from torch.distributed.fsdp import fully_shard

mode, dtype, ckpt, out = sys.argv[1], getattr(torch, sys.argv[2]), sys.argv[3], sys.argv[4]
torch.set_num_threads(1)
dist.init_process_group("gloo")
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(17, 13), torch.nn.ReLU(), torch.nn.Linear(13, 5)).to(dtype)
for layer in (m[0], m[2]):
    fully_shard(layer)
fully_shard(m)
opt = torch.optim.Adam(m.parameters(), lr=1e-2)
x = torch.linspace(-1, 1, 4 * 17).reshape(4, 17).to(dtype)

def step():
    opt.zero_grad(set_to_none=True)
    m(x).float().square().mean().backward()
    opt.step()

def dump(path):
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd = get_model_state_dict(m, options=full)
    osd = get_optimizer_state_dict(m, opt, options=full)
    if dist.get_rank() == 0:
        torch.save({"model": msd, "optim": osd}, path)

if mode == "save":
    step()
    msd, osd = get_state_dict(m, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt)
    dump(out + ".step1")
    step()
    dump(out + ".step2")
else:
    msd, osd = get_state_dict(m, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=ckpt)
    set_state_dict(m, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    dump(out)
# Out without the process group's teardown: torch 2.11's Gloo teardown after FSDP2 now and then
# aborts ("terminate called without an active exception") once everything is written.
dist.barrier()
sys.stdout.flush()
os._exit(0)
PYEOF

cat > "$T/compare.py" <<'PYEOF'
# python compare.py PY.pt CPP.pt TOL: the model and Adam state of a Python dump and a C++ one.
import sys
import torch
py, cpp, tol = torch.load(sys.argv[1]), sys.argv[2], float(sys.argv[3])
model = torch.load(cpp)
optim = torch.load(cpp + ".optim")
def close(a, b, what):
    a, b = a.float(), b.float()
    d = ((a - b).norm() / (b.norm() + 1e-30)).item()
    assert (torch.equal(a, b) if tol == 0 else d <= tol), (what, d)
assert set(model) == set(py["model"]), (sorted(model), sorted(py["model"]))
for k, v in py["model"].items():
    assert v.dtype == model[k].dtype, (k, v.dtype, model[k].dtype)
    close(model[k], v, k)
for k, st in py["optim"]["state"].items():
    for s in ("exp_avg", "exp_avg_sq"):
        close(optim["state"][k][s], st[s], k + "." + s)
    assert int(optim["state"][k]["step"]) == int(st["step"]), (k, optim["state"][k]["step"], st["step"])
print("equal" if tol == 0 else "within %g:" % tol, sorted(model))
PYEOF

run_fsdp2() { timeout -k 5 120 "${TORCHRUN[@]}" --standalone --nproc_per_node 2 "$T/fsdp2.py" "$@" 2>"$T/torchrun.err" ||
  { cat "$T/torchrun.err"; exit 1; }; }
run_cpp() { timeout -k 5 120 "$BIN/fsdp-run" --nproc 3 -- "$BIN/dcp_interop" "$@"; }

for dtype in float32 bfloat16; do
  cdtype=$([ "$dtype" = bfloat16 ] && echo bf16 || echo fp32)
  # 1. FSDP2 -> fsdp-cpp.
  run_fsdp2 save "$dtype" "$T/py_$dtype" "$T/py_$dtype.pt"
  run_cpp continue "$T/py_$dtype" "$T/cpp_loaded_$dtype.pt" 0 "$cdtype"
  echo -n "FSDP2 (2 ranks) -> fsdp-cpp (3 ranks), $dtype, loaded: "
  "$PY" "$T/compare.py" "$T/py_$dtype.pt.step1" "$T/cpp_loaded_$dtype.pt" 0
  if [ "$dtype" = float32 ]; then
    run_cpp continue "$T/py_$dtype" "$T/cpp_step2_$dtype.pt" 1 "$cdtype"
    echo -n "  and one more step on both sides: "
    "$PY" "$T/compare.py" "$T/py_$dtype.pt.step2" "$T/cpp_step2_$dtype.pt" 1e-6
  fi
  # 2. fsdp-cpp -> FSDP2.
  run_cpp save "$T/cpp_$dtype" "$T/cpp_saved_$dtype.pt" 1 "$cdtype"
  run_fsdp2 load "$dtype" "$T/cpp_$dtype" "$T/py_loaded_$dtype.pt"
  echo -n "fsdp-cpp (3 ranks) -> FSDP2 (2 ranks), $dtype: "
  "$PY" "$T/compare.py" "$T/py_loaded_$dtype.pt" "$T/cpp_saved_$dtype.pt" 0
done

"$PY" - "$T" <<'PYEOF'
import sys
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
t = sys.argv[1]
dcp_to_torch_save(t + "/cpp_float32", t + "/converted.pt")
c = torch.load(t + "/converted.pt")
ref = torch.load(t + "/cpp_saved_float32.pt")
for k, v in ref.items():
    assert torch.equal(c["model"][k], v), k
assert int(c["optim"]["state"]["0.weight"]["step"]) == 1
assert c["optim"]["param_groups"][0]["lr"] == 1e-2 and c["optim"]["param_groups"][0]["params"] == list(ref)
print("dcp_to_torch_save reads fsdp-cpp's checkpoint:", sorted(c["model"]))
PYEOF
echo "PASS"
