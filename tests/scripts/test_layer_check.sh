#!/usr/bin/env bash
# The layer map holds (scripts/check_layers.py against cmake/layers.cmake), and the check
# finds what it must: an upward include (quoted or <...>), an include that climbs with ../,
# an internal header in a public one, a tool reaching into src/, an include of no file, a
# source outside a layer folder, a declared dependency no include uses. Each is planted in a
# copy of the tree. Then the same map as the build enforces it: an upward include that does not
# compile, an upward call that does not link.
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

# caught WHAT FILE EXPECTED: the check fails on the copy with a line containing FILE and
# EXPECTED (WHAT says what was planted).
caught() {
  local what=$1 file=$2 expected=$3 out
  if out="$("$PY" "$SRC/scripts/check_layers.py" "$copy")"; then
    echo "FAIL: $what passes the check"
    status=1
  elif grep -F "$file" <<<"$out" | grep -qF "$expected"; then
    echo "ok: $what: $(grep -F "$file" <<<"$out" | grep -F "$expected" | head -1)"
  else
    echo "FAIL: $what: the check fails without saying '$expected' for $file:"
    echo "$out"
    status=1
  fi
}

# plant FILE LINE EXPECTED: add LINE at the top of FILE, expect it caught, restore FILE.
plant() {
  local file=$1 line=$2 expected=$3
  cp "$copy/$file" "$copy/$file.orig"
  { echo "$line"; cat "$copy/$file.orig"; } >"$copy/$file"
  caught "planted '$line' in $file" "$file" "$expected"
  mv "$copy/$file.orig" "$copy/$file"
}

# plant_file FILE EXPECTED: a new FILE (one #pragma once), expected caught, then removed.
plant_file() {
  local file=$1 expected=$2
  echo '#pragma once' >"$copy/$file"
  caught "a new file $file" "$file" "$expected"
  rm "$copy/$file"
}

# plant_edit FILE FROM TO EXPECTED: the line FROM of FILE becomes TO, expect the check to
# fail naming FILE and EXPECTED, restore FILE.
plant_edit() {
  local file=$1 from=$2 to=$3 expected=$4
  cp "$copy/$file" "$copy/$file.orig"
  if ! grep -qxF "$from" "$copy/$file.orig"; then
    echo "FAIL: no line '$from' in $file to plant into"
    status=1
    return
  fi
  awk -v from="$from" -v to="$to" '$0 == from { $0 = to } { print }' "$copy/$file.orig" >"$copy/$file"
  caught "'$from' made '$to' in $file" "$file" "$expected"
  mv "$copy/$file.orig" "$copy/$file"
}

plant src/comm/collectives.cpp '#include "fsdp/trainer/trainer.h"' "layer 'comm' may not use layer 'trainer'"
plant src/core/unit.cpp '#include "state/optim_state.h"' "layer 'core' may not use layer 'state'"
plant src/optim/zero_bucket_reducer.cpp '#include "core/unit.h"' "layer 'optim' may not use layer 'core'"
plant src/core/runtime.cpp '#include "../memory/buffer_pool.h"' "climbs with '../'"
plant include/fsdp/core/options.h '#include "core/unit.h"' "a public header includes an internal one"
plant tools/fsdp_train/train.cpp '#include "core/unit.h"' "uses public headers only"
plant src/state/checkpoint.cpp '#include "state/no_such_file.h"' "names no file of the tree"
# <...> includes of the project's count like quoted ones; <memory> stays the standard header.
plant src/comm/collectives.cpp '#include <fsdp/trainer/trainer.h>' "layer 'comm' may not use layer 'trainer'"
plant src/optim/zero_bucket_reducer.cpp '#include <core/unit.h>' "layer 'optim' may not use layer 'core'"
plant include/fsdp/core/options.h '#include <core/unit.h>' "a public header includes an internal one"
plant tools/fsdp_train/train.cpp '#include <core/unit.h>' "uses public headers only"
# Sources and headers outside a layer folder.
plant_file src/stray.h "outside a layer folder (src/ is no layer folder); move it into a layer folder"
plant_file include/fsdp/stray.h "outside a layer folder (include/fsdp/ is no layer folder); move it into a layer folder"
mkdir "$copy/src/nolayer"
plant_file src/nolayer/stray.cpp "outside a layer folder ('nolayer' is no layer of"
rmdir "$copy/src/nolayer"
# A declared dependency no include uses.
plant_edit cmake/layers.cmake 'fsdp_layer(autograd)' 'fsdp_layer(autograd DEPENDS comm)' \
  "layer 'autograd' declares DEPENDS comm, but no file of autograd"

# The build holds a layer to the map too (cmake/layer_rules.cmake): a project of two layers,
# low and high (high DEPENDS low), built with the same rules as the library. The clean project
# builds and passes fsdp_link_check; an upward include does not compile (the header is not in
# the layer's include root); an upward call through a hand-written declaration, which no
# include rule sees, does not link in fsdp_link_check.
mini="$copy/mini"
mkdir -p "$mini/src/low" "$mini/src/high"
cat >"$mini/CMakeLists.txt" <<CMAKE
cmake_minimum_required(VERSION 3.22)
project(mini CXX)
set(CMAKE_POSITION_INDEPENDENT_CODE ON)
include($SRC/cmake/layer_rules.cmake)
function(mini_layer name)
  cmake_parse_arguments(L "" "" "DEPENDS" \${ARGN})
  add_library(fsdp_\${name} STATIC \${CMAKE_SOURCE_DIR}/src/\${name}/\${name}.cpp)
  fsdp_layer_include_root(\${name} fsdp_\${name} "\${L_DEPENDS}")
  foreach(dep \${L_DEPENDS})
    target_link_libraries(fsdp_\${name} PUBLIC fsdp_\${dep})
  endforeach()
  fsdp_layer_link_check(fsdp_\${name})
endfunction()
mini_layer(low)
mini_layer(high DEPENDS low)
CMAKE
printf '#pragma once\nint low_value();\n' >"$mini/src/low/low.h"
printf '#include "low/low.h"\nint low_value() { return 1; }\n' >"$mini/src/low/low.cpp"
printf '#pragma once\nint high_value();\n' >"$mini/src/high/high.h"
printf '#include "high/high.h"\n#include "low/low.h"\nint high_value() { return low_value() + 1; }\n' \
  >"$mini/src/high/high.cpp"
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)

# mini_build WHAT EXPECTED TARGET...: configure and build the project; EXPECTED empty: the
# build must pass; otherwise it must fail saying EXPECTED.
mini_build() {
  local what=$1 expected=$2 out
  shift 2
  rm -rf "$mini/build"
  if out="$(cmake -S "$mini" -B "$mini/build" "${generator[@]}" 2>&1 &&
    for target in "$@"; do cmake --build "$mini/build" --target "$target" 2>&1 || exit 1; done)"; then
    if [[ -z "$expected" ]]; then echo "ok: $what builds and links"; return; fi
    echo "FAIL: $what builds and links"
  elif [[ -n "$expected" ]] && grep -qF "$expected" <<<"$out"; then
    echo "ok: $what: $(grep -F "$expected" <<<"$out" | head -1)"
    return
  else
    echo "FAIL: $what: the build did not go as expected (wanted '${expected:-success}'):"
    echo "$out" | tail -n 20
  fi
  status=1
}

mini_build "the clean two-layer project" "" all fsdp_link_check
cp "$mini/src/low/low.cpp" "$mini/low.cpp.orig"
{ echo '#include "high/high.h"'; cat "$mini/low.cpp.orig"; } >"$mini/src/low/low.cpp"
mini_build "an upward include in low" "high/high.h: No such file or directory" all
{ cat "$mini/low.cpp.orig"; printf 'int high_value();\nint low_calls_up() { return high_value(); }\n'; } \
  >"$mini/src/low/low.cpp"
mini_build "an upward call through a declaration in low" "undefined reference to \`high_value()'" all fsdp_link_check
mv "$mini/low.cpp.orig" "$mini/src/low/low.cpp"

((status == 0)) && echo "PASS: test_layer_check"
exit "$status"
