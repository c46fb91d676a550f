# Sourced by tests that consume the *installed* package (test_examples.sh).
# Needs FSDP_BIN_DIR (set by ctest: <build>/bin).
#
#   fsdp_install PREFIX            cmake --install of the build tree into PREFIX, checked
#   fsdp_build_consumer SRC BUILD PREFIX
#                                  configure + build the CMake project SRC in BUILD with
#                                  find_package(fsdp) seeing only PREFIX's package; fails
#                                  when the configure printed a warning but torch's own
#   fsdp_foreign_warnings LOG      the first line of each CMake warning in the configure
#                                  output LOG that torch's own CMake files did not print
#   fsdp_torch_warnings LOG        the first line of each one that they did
#
# Consumers compile through ccache when it is installed. The prefix lives in a fresh temp
# directory each run; CCACHE_BASEDIR set to that directory makes ccache see the include paths
# relative to the build directory, so the next run, in another temp directory, hits the cache.

FSDP_BUILD_DIR=$(cd "$FSDP_BIN_DIR/.." && pwd)

fsdp_install() {
  local prefix=$1
  cmake --install "$FSDP_BUILD_DIR" --prefix "$prefix" > "$prefix.install.log" 2>&1 \
    || { tail -20 "$prefix.install.log"; echo "FAIL: cmake --install $FSDP_BUILD_DIR"; return 1; }
  test -f "$prefix/lib/cmake/fsdp/fsdpConfig.cmake" || { echo "FAIL: no fsdpConfig.cmake installed"; return 1; }
  test -f "$prefix/include/fsdp/core/fully_sharded.h" || { echo "FAIL: headers not installed"; return 1; }
}

# A CMake warning starts with a line "CMake Warning at FILE:LINE (command):" (or "CMake
# Warning (dev) at", "CMake Deprecation Warning at", or no location at all). Those of torch's
# config files are torch's (docs/usage.md explains the ones seen); any other, at our package's
# files or at a consumer's target (whose link line is partly ours), is ours to fix.
FSDP_TORCH_WARNING_RE='^CMake [A-Za-z ()]*Warning[A-Za-z ()]* at (.*/)?share/cmake/(Torch|Caffe2)/'
fsdp_foreign_warnings() { grep -E '^CMake [A-Za-z ()]*Warning' "$1" | grep -vE "$FSDP_TORCH_WARNING_RE" || true; }
fsdp_torch_warnings() { grep -E "$FSDP_TORCH_WARNING_RE" "$1" || true; }

fsdp_build_consumer() {
  local src=$1 build=$2 prefix=$3
  local launcher=()
  if command -v ccache > /dev/null; then
    launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
    export CCACHE_BASEDIR
    CCACHE_BASEDIR=$(dirname "$prefix")
  fi
  mkdir -p "$build"
  # Release, at -O1: what is checked is that the package builds and links; the optimiser's
  # -O3 passes would only lengthen the compile of these one-unit projects.
  cmake -S "$src" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_FLAGS_RELEASE="-O1 -DNDEBUG" \
    -DCMAKE_PREFIX_PATH="$prefix" "${launcher[@]}" > "$build/configure.log" 2>&1 \
    || { cat "$build/configure.log"; echo "FAIL: configuring $src against $prefix (find_package(fsdp))"; return 1; }
  local foreign
  foreign=$(fsdp_foreign_warnings "$build/configure.log")
  [[ -z "$foreign" ]] || { cat "$build/configure.log"
    echo "FAIL: configuring $src against $prefix printed warnings that torch's CMake files did not:"
    echo "$foreign"; return 1; }
  cmake --build "$build" > "$build/build.log" 2>&1 \
    || { tail -30 "$build/build.log"; echo "FAIL: building $src against $prefix"; return 1; }
}
