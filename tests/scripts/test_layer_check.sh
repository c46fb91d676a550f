#!/usr/bin/env bash
# The layer map holds (scripts/check_layers.py against cmake/layers.cmake), and the check
# finds what it must: an upward include, an include that climbs with ../, an internal
# header in a public one, a tool reaching into src/. Each is planted in a copy of the tree.
set -euo pipefail
SRC="${FSDP_SOURCE_DIR:?set FSDP_SOURCE_DIR to the source tree}"
PY="${FSDP_PYTHON:-python3}"
status=0

if out="$("$PY" "$SRC/scripts/check_layers.py" "$SRC")"; then
  echo "ok: the tree keeps the layer map"
else
  echo "FAIL: the tree breaks the layer map:"
  echo "$out"
  status=1
fi

copy="$(mktemp -d)"
trap 'rm -rf "$copy"' EXIT
cp -r "$SRC/src" "$SRC/include" "$SRC/tools" "$SRC/examples" "$copy/"
mkdir -p "$copy/cmake" && cp "$SRC/cmake/layers.cmake" "$copy/cmake/"

# plant FILE LINE EXPECTED: add LINE at the top of FILE, expect the check to fail with a
# line containing FILE and EXPECTED, then restore FILE.
plant() {
  local file=$1 line=$2 expected=$3
  cp "$copy/$file" "$copy/$file.orig"
  { echo "$line"; cat "$copy/$file.orig"; } >"$copy/$file"
  if out="$("$PY" "$SRC/scripts/check_layers.py" "$copy")"; then
    echo "FAIL: planted '$line' in $file passes the check"
    status=1
  elif grep -F "$file" <<<"$out" | grep -qF "$expected"; then
    echo "ok: planted '$line' in $file: $(grep -F "$file" <<<"$out" | head -1)"
  else
    echo "FAIL: planted '$line' in $file: the check fails without saying '$expected':"
    echo "$out"
    status=1
  fi
  mv "$copy/$file.orig" "$copy/$file"
}

plant src/comm/collectives.cpp '#include "fsdp/trainer/trainer.h"' "layer 'comm' may not use layer 'trainer'"
plant src/core/unit.cpp '#include "state/optim_state.h"' "layer 'core' may not use layer 'state'"
plant src/optim/zero_bucket_reducer.cpp '#include "core/unit.h"' "layer 'optim' may not use layer 'core'"
plant src/core/runtime.cpp '#include "../memory/buffer_pool.h"' "climbs with '../'"
plant include/fsdp/core/options.h '#include "core/unit.h"' "a public header includes an internal one"
plant tools/fsdp_train/train.cpp '#include "core/unit.h"' "uses public headers only"
plant src/state/checkpoint.cpp '#include "state/no_such_file.h"' "names no file of the tree"

((status == 0)) && echo "PASS: test_layer_check"
exit "$status"
