#!/usr/bin/env bash
# Gathers, on a Debian machine with network (a developer's or CI's), every build and test
# dependency of fsdp-cpp except torch into an ignored folder, .gpu-deps/ by default, for
# scripts/gpu_check.sh and scripts/gpu_bench.sh to use on a GPU machine that has PyTorch,
# nvcc, CMake, ninja and gcc but no network and none of our Debian packages.
#
# Debian 12's packages, downloaded with `apt-get download` and unpacked with `dpkg -x` (no
# install: nothing on this machine changes). They are built for glibc 2.36 and run on newer
# ones (Ubuntu 24.04 has 2.39); the CMake package files they ship find their files relative
# to themselves, so the folder works wherever it is copied.
#
#   root/   Highway (headers, CMake package and its runtime .so: libhwy-dev ships no
#           static library), nlohmann-json, CLI11, GoogleTest/GoogleMock (static),
#           Google Benchmark, Gloo's headers, libdeflate (the checkpoint CRC-32's fast path,
#           dlopen'ed; zlib is the fallback)
#   zlib/   zlib's headers and libraries, in a prefix of their own: gpu_check.sh uses them
#           only where the GPU machine has no zlib.h, and they never shadow its libz.so.1
#   data/   Fashion-MNIST (dataset-fashion-mnist, ~30 MB), which fsdp-train's script tests
#           read from /usr/share/datasets/fashion-mnist; GPU_DEPS_NO_DATA=1 leaves it out
#   MANIFEST.txt  the packages, their versions and the .debs' SHA-256
#
# Left out: googletest (GoogleTest's sources under /usr/src; libgtest-dev's CMake package uses
# its prebuilt static libraries), documentation. Everything lands in about 40 MB (8 MB without
# the data).
#
# Usage: bash scripts/gather_gpu_deps.sh [DEST]     (DEST defaults to <checkout>/.gpu-deps)
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-.gpu-deps}

ROOT_PACKAGES=(
  libhwy-dev libhwy1                       # find_package(hwy): libhwy.so only, so the .so too
  nlohmann-json3-dev                       # find_package(nlohmann_json)
  libcli11-dev                             # find_package(CLI11) (fsdp-train)
  libgtest-dev libgmock-dev                # find_package(GTest): static libgtest.a, libgmock.a
  libbenchmark-dev libbenchmark1debian     # Google Benchmark (no target uses it yet)
  libgloo-dev                              # FSDP_GLOO_INCLUDE_DIR: gloo/config.h
  libdeflate0                              # fast CRC-32, loaded at run time
)
ZLIB_PACKAGES=(zlib1g-dev zlib1g)
DATA_PACKAGES=(dataset-fashion-mnist)

all=("${ROOT_PACKAGES[@]}" "${ZLIB_PACKAGES[@]}")
[[ "${GPU_DEPS_NO_DATA:-0}" == 1 ]] || all+=("${DATA_PACKAGES[@]}")

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
chmod 755 "$tmp"  # apt-get download runs as _apt where it can
echo "gather_gpu_deps: downloading ${all[*]}"
if ! (cd "$tmp" && apt-get download -qq "${all[@]}" 2>"$tmp/err"); then
  # No package lists yet (a fresh machine): update them once and try again.
  SUDO=""
  [[ $(id -u) -eq 0 ]] || SUDO="sudo"
  echo "gather_gpu_deps: apt-get download failed ($(head -c 300 "$tmp/err")); running apt-get update"
  $SUDO apt-get update -qq
  (cd "$tmp" && apt-get download -qq "${all[@]}")
fi

rm -rf "$DEST"
mkdir -p "$DEST/root" "$DEST/zlib" "$DEST/data"
deb_of() { ls "$tmp/$1"_*.deb; }
{
  echo "# fsdp-cpp GPU-machine dependencies, gathered $(date -u +%Y-%m-%dT%H:%MZ) by scripts/gather_gpu_deps.sh"
  echo "# from $(. /etc/os-release && echo "$PRETTY_NAME"), $(dpkg --print-architecture)"
  echo "# folder package version sha256(.deb)"
} >"$DEST/MANIFEST.txt"
unpack() {
  local into=$1; shift
  local p deb
  for p in "$@"; do
    deb=$(deb_of "$p")
    dpkg -x "$deb" "$DEST/$into"
    printf '%s %s %s %s\n' "$into" "$p" "$(dpkg-deb -f "$deb" Version)" "$(sha256sum "$deb" | cut -d' ' -f1)" \
      >>"$DEST/MANIFEST.txt"
  done
}
unpack root "${ROOT_PACKAGES[@]}"
unpack zlib "${ZLIB_PACKAGES[@]}"
[[ "${GPU_DEPS_NO_DATA:-0}" == 1 ]] || unpack data "${DATA_PACKAGES[@]}"

# Documentation stays behind (nlohmann-json's examples alone are 1 MB), copyrights stay; so
# does libgtest-dev's link to the sources we leave out (/usr/src/gtest -> googletest).
rm -rf "$DEST"/root/usr/src
# libgloo-dev's libgloo.so links to libgloo0's library, which we do not bring: c10d's Gloo is
# inside the torch wheel's libtorch; only Gloo's headers are needed (and not its CMake package,
# which names that library).
rm -f "$DEST"/root/usr/lib/libgloo.so
rm -rf "$DEST"/root/usr/share/cmake/Gloo "$DEST"/*/usr/share/man
find "$DEST" -path '*/usr/share/doc/*' -type f ! -name copyright -delete
find "$DEST" -path '*/usr/share/doc/*' -type l -delete
find "$DEST" -depth -type d -empty -delete
mkdir -p "$DEST/data"

# dpkg -x keeps absolute symbolic links, which would point outside the folder once copied:
# make every link relative (zlib1g's libz.so.1 -> /lib/... sort of thing), or fail.
while IFS= read -r link; do
  target=$(readlink "$link")
  [[ "$target" == /* ]] || continue
  rel=${link#"$DEST"/}
  prefix="$DEST/${rel%%/*}"
  inside="$prefix$target"
  [[ -e "$inside" ]] || inside="$prefix/usr$target"  # /lib/x.so -> <prefix>/usr/lib/x.so
  [[ -e "$inside" ]] || { echo "gather_gpu_deps: $link -> $target has no counterpart inside $prefix" >&2; exit 1; }
  ln -sfn "$(realpath --relative-to="$(dirname "$link")" "$inside")" "$link"
done < <(find "$DEST" -type l)
# Every link must resolve inside the folder.
while IFS= read -r link; do
  [[ -e "$link" ]] || { echo "gather_gpu_deps: dangling link $link -> $(readlink "$link")" >&2; exit 1; }
done < <(find "$DEST" -type l)

# What gpu_check.sh relies on.
lib=usr/lib/x86_64-linux-gnu
for f in root/$lib/cmake/hwy/hwy-config.cmake root/$lib/cmake/GTest/GTestConfig.cmake \
  root/usr/share/cmake/nlohmann_json/nlohmann_jsonConfig.cmake root/usr/share/cmake/CLI11/CLI11Config.cmake \
  root/$lib/cmake/benchmark/benchmarkConfig.cmake root/usr/include/gloo/config.h root/$lib/libhwy.so.1 \
  root/$lib/libdeflate.so.0 zlib/usr/include/zlib.h zlib/$lib/libz.so; do
  [[ -e "$DEST/$f" ]] || { echo "gather_gpu_deps: $DEST/$f missing after unpacking" >&2; exit 1; }
done

echo "gather_gpu_deps: $DEST holds $(du -sh "$DEST" | cut -f1) in $(find "$DEST" -type f | wc -l) files:"
du -sh "$DEST"/root "$DEST"/zlib "$DEST"/data | sed 's/^/  /'
echo "Next, on the GPU machine (with this checkout and $DEST copied there): bash scripts/gpu_check.sh"
