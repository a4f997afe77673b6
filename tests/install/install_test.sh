#!/usr/bin/env bash
# The user's view of an installed Shoal: `cmake --install` into a prefix, examples/ configured and
# built as a project of its own with find_package(Shoal) against that prefix (nothing from the
# build tree), its program run as two ranks under the installed `shoal run`, and the same object
# linked again with only `pkg-config --libs shoal`.
#
#   install_test.sh BUILD_DIR SOURCE_DIR [PREFIX]
# With PREFIX given, nothing is installed: the examples build against PREFIX (an unpacked .deb).
set -euo pipefail
build=$(cd "$1" && pwd)
source=$(cd "$2" && pwd)
work=$build/install-test
mkdir -p "$work"
if [ $# -ge 3 ]; then
  prefix=$3
  work=$work/given-prefix
  mkdir -p "$work"
else
  prefix=$work/prefix
  rm -rf "$prefix"
  cmake --install "$build" --prefix "$prefix" >"$work/install.log"
fi
fail() { echo "install_test: FAIL: $*" >&2; exit 1; }

for f in include/shoal/shoal.h bin/shoal; do
  [ -e "$prefix/$f" ] || fail "$prefix/$f was not installed"
done
config=$(find "$prefix" -name ShoalConfig.cmake | head -n1)
[ -n "$config" ] || fail "no ShoalConfig.cmake under $prefix"
[ -e "$(dirname "$config")/ShoalConfigVersion.cmake" ] || fail "no ShoalConfigVersion.cmake"
libdir=$(dirname "$(dirname "$(dirname "$config")")")
for f in libshoal.a libshoal.so; do
  [ -e "$libdir/$f" ] || fail "$libdir/$f was not installed"
done
# libshoal.a is position-independent: all of it links into a shared library.
c++ -shared -o "$work/libwhole.so" -Wl,--whole-archive "$libdir/libshoal.a" -Wl,--no-whole-archive \
  2>"$work/whole.log" || { head -n 5 "$work/whole.log"; fail "libshoal.a does not link into a shared library (not -fPIC)"; }

# A separate CMake project: the examples, one of them, against the installed tree only. Without
# optimisation (the work is in LibTorch's kernels anyway) and through ccache with a fixed base dir
# the compile of LibTorch's headers stays short (~20 CPU-seconds; reruns hit the cache).
launcher=()
if command -v ccache >/dev/null; then
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
  export CCACHE_BASEDIR=$work
fi
rm -rf "$work/examples"
cmake -S "$source/examples" -B "$work/examples" -G Ninja -DCMAKE_BUILD_TYPE= \
  -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF \
  -DSHOAL_EXAMPLES=ddp_fashion_mnist "${launcher[@]}" >"$work/configure.log" 2>&1 \
  || { cat "$work/configure.log"; fail "configuring examples/ against $prefix"; }
grep -q "shoal" "$work/examples/CMakeCache.txt"
grep -q "^Shoal_DIR:PATH=$prefix" "$work/examples/CMakeCache.txt" \
  || fail "examples/ found a Shoal other than $prefix: $(grep ^Shoal_DIR "$work/examples/CMakeCache.txt")"
cmake --build "$work/examples" -j1 >"$work/build.log" 2>&1 \
  || { tail -n 30 "$work/build.log"; fail "building examples/ against $prefix"; }
example=$work/examples/example_ddp_fashion_mnist
# grep -q on a pipe under pipefail fails at random: grep exits at the first match and the
# writer dies of SIGPIPE. Every check below reads a captured string instead.
linked=$(ldd "$example")
grep -q "$libdir/libshoal.so" <<<"$linked" \
  || fail "the example is not linked to $libdir/libshoal.so: $(grep shoal <<<"$linked")"

# Two ranks under the installed launcher; one epoch, and rank 0 saves a checkpoint.
rm -f "$work/example.pt"
out=$(OMP_NUM_THREADS=1 timeout 120 "$prefix/bin/shoal" run --nproc-per-node 2 \
        "$example" 1 "$work/example.pt" 2>&1) || { echo "$out"; fail "shoal run exited $?"; }
echo "$out"
grep -q "\[rank 0\] epoch 0: loss [0-9.]* (2 ranks x 32 steps)" <<<"$out" \
  || fail "expected rank 0's 'epoch 0: loss ... (2 ranks x 32 steps)' line"
[ -s "$work/example.pt" ] || fail "rank 0 wrote no checkpoint"

# pkg-config: the same object linked with only the flags shoal.pc gives, run as one process.
export PKG_CONFIG_PATH=$libdir/pkgconfig
pkg-config --exists shoal || fail "pkg-config does not find shoal.pc in $libdir/pkgconfig"
object=$(find "$work/examples" -name "ddp_fashion_mnist.cpp.o" | head -n1)
# shellcheck disable=SC2046
c++ -o "$work/example_pkgconfig" "$object" $(pkg-config --libs shoal) -Wl,-rpath,"$libdir" \
  || fail "linking with pkg-config --libs shoal"
out=$(OMP_NUM_THREADS=1 timeout 60 "$work/example_pkgconfig" 1 2>&1) || { echo "$out"; fail "pkg-config build exited $?"; }
grep -q "epoch 0: loss [0-9.]* (1 ranks x 64 steps)" <<<"$out" || { echo "$out"; fail "pkg-config build output"; }
for flag in $(pkg-config --cflags shoal); do
  case $flag in -I*) [ -d "${flag#-I}" ] || fail "pkg-config names a missing include dir: $flag";; esac
done
# add_subdirectory: a project that pulls the source tree in gets Shoal::shoal with LibTorch's
# targets visible, and none of the CLI, tests or benchmarks (configured and generated only: a
# build would compile the library again).
if [ $# -lt 3 ]; then
  sub=$work/subdirectory
  rm -rf "$sub"
  mkdir -p "$sub"
  cat >"$sub/CMakeLists.txt" <<CMAKE
cmake_minimum_required(VERSION 3.18)
project(user LANGUAGES CXX)
add_subdirectory("$source" shoal)
add_executable(app main.cpp)
target_link_libraries(app PRIVATE Shoal::shoal)
foreach(target shoal_cli test_trainer shm_allreduce_bench example_ddp_fashion_mnist)
  if(TARGET \${target})
    message(FATAL_ERROR "\${target} is built when Shoal is a subdirectory")
  endif()
endforeach()
CMAKE
  echo 'int main() {}' >"$sub/main.cpp"
  cmake -S "$sub" -B "$sub/build" -G Ninja >"$sub/configure.log" 2>&1 \
    || { tail -n 20 "$sub/configure.log"; fail "add_subdirectory of the source tree"; }
  app_rule=$(grep -A2 "^build app:" "$sub/build/build.ninja")
  grep -q "libshoal.so.*libtorch" <<<"$app_rule" \
    || fail "under add_subdirectory, app does not link libshoal.so and LibTorch"
fi
echo "install_test: OK ($prefix)"
