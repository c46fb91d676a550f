#!/usr/bin/env bash
# Full state dicts between the library and Python PyTorch (Debian's python3-torch
# under /usr/bin/python3), both ways: C++ save -> Python torch.load + strict
# load_state_dict into the equivalent torch.nn model (same outputs); Python
# torch.save(state_dict) -> C++ load_state_dict (same outputs).
set -euo pipefail
BIN=${FSDP_BIN_DIR:?FSDP_BIN_DIR must point at the build bin directory}
PY=/usr/bin/python3
if ! "$PY" -c 'import torch' 2>/dev/null; then
  if [ "${CI:-}" = "true" ]; then echo "FAIL: $PY has no torch (install python3-torch)"; exit 1; fi
  echo "SKIP: $PY has no torch (install Debian's python3-torch)"; exit 0
fi
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT

MODEL='torch.nn.Sequential(torch.nn.Linear(13,32), torch.nn.ReLU(), torch.nn.Linear(32,17), torch.nn.ReLU(), torch.nn.Linear(17,5))'

# 1. C++ -> Python
"$BIN/state_dict_interop" save "$T/cpp_model.pt" "$T/cpp_out.pt"
"$PY" - "$T" <<PYEOF
import sys, torch
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
t = sys.argv[1]
torch.manual_seed(7)
m = $MODEL
torch.save(dict(m.state_dict()), t + "/py_model.pt")  # a plain dict
x = torch.linspace(-1, 1, 4 * 13).reshape(4, 13)
with torch.no_grad():
    torch.save(m(x), t + "/py_out.pt")
PYEOF
"$BIN/state_dict_interop" load "$T/py_model.pt" "$T/py_out.pt"

# 3. The check can fail: Python's output against a differently initialised C++ model.
if "$BIN/state_dict_interop" load "$T/cpp_model.pt" "$T/py_out.pt" >/dev/null; then
  echo "FAIL: a mismatched model passed the output check"; exit 1
fi
echo "PASS"
