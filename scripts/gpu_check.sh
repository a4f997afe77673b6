#!/usr/bin/env bash
# On a machine with NVIDIA GPUs and PyTorch 2.x: builds Shoal against that PyTorch's LibTorch and
# runs the GPU tests (CTest label gpu: the nccl backend on one GPU per process, the fp16 recipe
# with GradScaler under CUDA autocast) and the DDP
# benchmark, all in about 10 minutes on 16 cores.
#
#   scripts/gpu_check.sh                  # python3's torch, else the PyPI LibTorch of setup_torch_pypi.sh
#   PYTHON=/opt/venv/bin/python scripts/gpu_check.sh
#   GPU_CHECK_REHEARSE=1 scripts/gpu_check.sh   # on a CPU machine: every step up to the first
#                                               # CUDA call (build, test programs, benchmark start)
#   scripts/gpu_check.sh --fetch-debs DIR       # on Debian 12: download the build dependencies'
#                                               # .debs for a GPU machine that has no apt access
#   GPU_CHECK_DEBS=DIR scripts/gpu_check.sh     # there: unpack them instead of scripts/setup.sh;
#                                               # only files / lacks are added, none replaced
#
# Writes its log and results to build-gpu/gpu_check/. Exit 0: everything passed (or, rehearsing,
# everything up to the first CUDA call did).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
BUILD=${GPU_CHECK_BUILD:-build-gpu}
OUT=$BUILD/gpu_check
JOBS=${JOBS:-$(nproc)}
REHEARSE=${GPU_CHECK_REHEARSE:-0}
start=$SECONDS
say() { echo "gpu_check [$((SECONDS - start)) s]: $*"; }

# Shoal's build dependencies that a GPU machine's image (with CUDA, PyTorch, CMake, ninja, g++)
# may lack, and what they need at run time, as Debian 12 packages.
DEBS=(libzmq3-dev libzmq5 cppzmq-dev libsodium23 libpgm-5.3-0 libnorm1 libbsd0 libmd0
      libgssapi-krb5-2 libkrb5-3 libk5crypto3 libkrb5support0 libcom-err2 libkeyutils1
      libspdlog-dev libspdlog1.10 libfmt-dev libfmt9 nlohmann-json3-dev libcli11-dev
      libgtest-dev libgmock-dev zlib1g-dev pkg-config pkgconf pkgconf-bin libpkgconf3
      libgloo-dev)  # c10d's ProcessGroupGloo.hpp includes gloo/*.h
if [ "${1:-}" = "--fetch-debs" ]; then
  [ -n "${2:-}" ] || { echo "usage: scripts/gpu_check.sh --fetch-debs DIR" >&2; exit 2; }
  mkdir -p "$2" && (cd "$2" && apt-get download "${DEBS[@]}")
  say "$(ls "$2"/*.deb | wc -l) packages in $2"
  exit 0
fi

# Unpacks the .debs of GPU_CHECK_DEBS and copies in the files / does not have (cp -n: nothing
# already there is replaced, so the image's own libraries stay as they are).
install_debs() {
  local dir=$1 root=/tmp/shoal-gpu-debs
  rm -rf "$root" && mkdir -p "$root"
  for deb in "$dir"/*.deb; do dpkg-deb -x "$deb" "$root" 2>/dev/null || dpkg -x "$deb" "$root"; done
  # Its private requirements (krb5-gssapi, libsodium, ...) have no .pc here: linking needs none.
  sed -i '/^Requires.private/d' "$root"/usr/lib/x86_64-linux-gnu/pkgconfig/libzmq.pc
  cp -rn "$root"/usr/. /usr/
  ldconfig
  say "unpacked $(ls "$dir"/*.deb | wc -l) packages from $dir (files / lacked only)"
}

# 1. PyTorch 2.x: the python's own, else the PyPI wheel in the cache (PYTHONPATH).
PYTHON=${PYTHON:-python3}
if ! prefix=$("$PYTHON" -c 'import torch, sys; assert int(torch.__version__.split(".")[0]) >= 2; print(torch.utils.cmake_prefix_path)' 2>/dev/null); then
  say "$PYTHON has no PyTorch 2.x; using the PyPI wheel of scripts/setup_torch_pypi.sh"
  torch_dir=$(bash scripts/setup_torch_pypi.sh | tail -n 1)
  export PYTHONPATH="$(dirname "$torch_dir")${PYTHONPATH:+:$PYTHONPATH}"
  prefix="$torch_dir/share/cmake"
fi
torch_root=$(cd "$prefix/../.." && pwd)  # .../site-packages/torch
version=$("$PYTHON" -W ignore -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda)' 2>/dev/null)
say "PyTorch $version at $torch_root"

# 2. GPUs (nvidia-smi does not initialise CUDA in this process).
gpus=0
if command -v nvidia-smi >/dev/null 2>&1; then gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true); fi
say "$gpus GPU(s)"
if [ "$gpus" -eq 0 ] && [ "$REHEARSE" != 1 ]; then
  say "error: no NVIDIA GPU found (nvidia-smi -L); set GPU_CHECK_REHEARSE=1 to rehearse on CPU" >&2
  exit 1
fi

# 3. Build what the check runs (Debian's packages from scripts/setup.sh; ccache when present).
if [ -n "${GPU_CHECK_DEBS:-}" ]; then install_debs "$GPU_CHECK_DEBS"; else bash scripts/setup.sh; fi
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$torch_root" \
      -DSHOAL_BUILD_EXAMPLES=OFF -DSHOAL_GPU_TEST_PYTHON="$(command -v "$PYTHON")" \
      >"$BUILD.configure.log" 2>&1 || { tail -n 30 "$BUILD.configure.log"; exit 1; }
grep -q "NCCL backend: ON" "$BUILD.configure.log" ||
  { say "error: this LibTorch has no CUDA (the NCCL backend is off)"; grep "shoal:" "$BUILD.configure.log"; exit 1; }
mkdir -p "$OUT"
say "building with $JOBS jobs"
cmake --build "$BUILD" -j "$JOBS" --target shoal_cli test_nccl test_grad_scaler_cuda tests_train \
      >"$OUT/build.log" 2>&1 ||
  { tail -n 40 "$OUT/build.log"; exit 1; }
say "built"

# 4. The GPU tests. Rehearsing, they run to the GPU probe and report skipped (exit 77).
# The scaler's oracle runs too: its CUDA cases (--device cuda, fp16) against this PyTorch's
# torch.amp on the GPU, the CPU cases against its GradScaler("cpu").
(cd "$BUILD" && SHOAL_ORACLE_PYTHON="$(command -v "$PYTHON")" \
   ctest -R '^(test_nccl|test_grad_scaler_cuda|test_grad_scaler_pytorch|test_cli_train_cuda)$' --output-on-failure --timeout 600) 2>&1 |
  tee "$OUT/ctest.log" || true
ctest_failed=0
grep -q "tests passed, 0 tests failed" "$OUT/ctest.log" || ctest_failed=1
if [ "$REHEARSE" != 1 ] && grep -q "Skipped" "$OUT/ctest.log"; then
  say "error: GPU tests were skipped on a machine with $gpus GPU(s)"; exit 1
fi

# 5. DDP benchmark: the nccl backend against gloo, one process per GPU, on CUDA. Runs when the
#    benchmark has --device (bench ddp trains on CPU until it does; see the report it prints).
world=$(( gpus > 0 ? (gpus < 4 ? gpus : 4) : 1 ))
shoal="$BUILD/apps/shoal/shoal"
"$shoal" bench ddp --help >"$OUT/bench_help.txt"
if ! grep -q -- "--device" "$OUT/bench_help.txt"; then
  say "note: 'shoal bench ddp' has no --device option yet: no CUDA benchmark run"
elif [ "$gpus" -eq 0 ]; then
  say "rehearsal: would run $shoal bench ddp --device cuda --backend nccl,gloo --world $world"
else
  "$shoal" bench ddp --device cuda --backend nccl,gloo --world "$world" --json |
    tee "$OUT/bench_ddp.jsonl"
fi
say "done in $((SECONDS - start)) s; results in $OUT"
if [ "$ctest_failed" = 1 ]; then say "error: a GPU test failed (see $OUT/ctest.log)"; exit 1; fi
