# Sourced by tests that consume the *installed* package (test_examples.sh).
# Needs FSDP_BIN_DIR (set by ctest: <build>/bin).
#
#   fsdp_install PREFIX            cmake --install of the build tree into PREFIX, checked
#   fsdp_build_consumer SRC BUILD PREFIX
#                                  configure + build the CMake project SRC in BUILD with
#                                  find_package(fsdp) seeing only PREFIX's package
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
  cmake --build "$build" > "$build/build.log" 2>&1 \
    || { tail -30 "$build/build.log"; echo "FAIL: building $src against $prefix"; return 1; }
}
