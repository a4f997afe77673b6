#!/usr/bin/env bash
# Installs PyTorch 2.x's LibTorch from PyPI's `torch` wheel into a cache folder, for the second build
# leg (`make test TORCH=pypi`), and prints that folder (the CMAKE_PREFIX_PATH) on its last line.
#
#   scripts/setup_torch_pypi.sh            # install when missing, print the prefix
#   scripts/setup_torch_pypi.sh --prefix   # print the prefix only, install nothing
#
# The wheel carries LibTorch's headers, libraries and CMake config (torch/share/cmake). Linux wheels
# are CUDA builds: their libraries need the CUDA runtime libraries at link and load time. Each one
# the machine's CUDA toolkit (ldconfig, /usr/local/cuda) does not provide is installed from PyPI's
# nvidia-* wheel into the same folder, where LibTorch's RPATH ($ORIGIN/../../nvidia/...) finds it.
# The same folder also gets the wheel's pure-Python dependencies, so that
# `PYTHONPATH=<folder> python3.11` imports torch 2.x (torchrun, the Python DDP peer).
#
# Idempotent: a finished install is marked with .complete and is not touched again.
set -euo pipefail

TORCH_VERSION="${SHOAL_TORCH_PYPI_VERSION:-2.15.0}"
PY_VERSION=3.11  # the wheel's CPython ABI: Debian 12's python3 and the python3 first on PATH
CACHE="${SHOAL_TORCH_CACHE:-$HOME/.cache/shoal}"
TARGET="$CACHE/torch-$TORCH_VERSION"

if [ "${1:-}" = "--prefix" ]; then
  echo "$TARGET/torch"
  exit 0
fi
# numpy and torchft came later (the DDP oracle of the 2.x leg needs them): an install that predates
# them is topped up below instead of being redone.
TOP_UP=0
if [ -f "$TARGET/.complete" ]; then
  if [ -d "$TARGET/numpy" ] && [ -d "$TARGET/torchft" ]; then
    echo "$TARGET/torch"
    exit 0
  fi
  TOP_UP=1
fi

# The CUDA libraries LibTorch 2.15's libraries load (DT_NEEDED), each with the PyPI wheel that
# carries it, pinned as torch 2.15.0's own requirements pin them (through cuda-toolkit 13.2.2).
NEEDED_CUDA_LIBS=(
  "libcudart.so.13       nvidia-cuda-runtime==13.2.86.*"
  "libcupti.so.13        nvidia-cuda-cupti==13.2.86.*"
  "libnvrtc.so.13        nvidia-cuda-nvrtc==13.2.86.*"
  "libcublas.so.13       nvidia-cublas==13.4.1.3.*"
  "libcublasLt.so.13     nvidia-cublas==13.4.1.3.*"
  "libcufft.so.12        nvidia-cufft==12.2.0.57.*"
  "libcusparse.so.12     nvidia-cusparse==12.7.10.12.*"
  "libcusolver.so.12     nvidia-cusolver==12.2.0.11.*"
  "libnvJitLink.so.13    nvidia-nvjitlink==13.2.86.*"
  "libcufile.so.0        nvidia-cufile==1.17.1.22.*"
  "libcusparseLt.so.0    nvidia-cusparselt-cu13==0.8.1"
  "libcudnn.so.9         nvidia-cudnn-cu13==9.26.0.51"
  "libnvshmem_host.so.3  nvidia-nvshmem-cu13==3.7.2"
)
# Pure-Python dependencies of `import torch` (for torchrun and the Python peer).
PYTHON_DEPS=(filelock "typing-extensions>=4.13.0" "sympy>=1.13.3" mpmath "networkx>=2.5.1"
             jinja2 markupsafe "fsspec>=0.8.5")
# And what the PyTorch oracle scripts import besides torch (test_ddp_vs_pytorch on the 2.x leg;
# torchft: its LocalSGD and DiLoCo, which ddp_oracle.py runs where torchft imports).
ORACLE_DEPS=(numpy torchft)

if [ "$TORCH_VERSION" != "2.15.0" ]; then
  echo "setup_torch_pypi: note: the CUDA library pins below are those of torch 2.15.0" >&2
fi

# A pip to download with: the first python3 on PATH that has pip, else Debian's.
PIP=()
for py in python3 /usr/bin/python3; do
  if command -v "$py" >/dev/null 2>&1 && "$py" -m pip --version >/dev/null 2>&1; then
    PIP=("$py" -m pip)
    break
  fi
done
if [ ${#PIP[@]} -eq 0 ]; then
  echo "setup_torch_pypi: error: no pip found (apt-get install python3-pip)" >&2
  exit 1
fi

has_system_lib() {
  grep -q "^[[:space:]]*$1 " <<<"$(ldconfig -p 2>/dev/null)" && return 0
  local d
  for d in /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/local/cuda/targets/x86_64-linux/lib; do
    [ -e "$d/$1" ] && return 0
  done
  return 1
}

# NCCL always comes from its wheel: LibTorch 2.15 calls NCCL 2.30 functions (ncclCommSuspend...)
# that the CUDA toolkit's older NCCL lacks, and the NCCL backend needs it.
wheels=("nvidia-nccl-cu13==2.30.7")
for entry in "${NEEDED_CUDA_LIBS[@]}"; do
  read -r lib req <<<"$entry"
  if ! has_system_lib "$lib"; then
    case " ${wheels[*]-} " in *" $req "*) ;; *) wheels+=("$req") ;; esac
  fi
done

DL="$CACHE/downloads/torch-$TORCH_VERSION"
mkdir -p "$DL"
# Linux x86-64 wheels for glibc 2.17 to 2.28 (Debian 12 has 2.36; torch's wheel needs 2.28).
PLATFORMS=(--platform manylinux2014_x86_64)
for minor in $(seq 17 28); do PLATFORMS+=(--platform "manylinux_2_${minor}_x86_64"); done
fetch() {
  # --python-version/--platform: the wheels for CPython 3.11 on Linux x86-64, whatever runs pip.
  if ! "${PIP[@]}" download --quiet --no-deps --only-binary=:all: --python-version "$PY_VERSION" \
        "${PLATFORMS[@]}" --dest "$DL" "$@" >"$CACHE/pip-download.log" 2>&1; then
    echo "setup_torch_pypi: error: downloading $* from PyPI failed (no network, or PyPI" \
         "unreachable?); see $CACHE/pip-download.log:" >&2
    tail -n 5 "$CACHE/pip-download.log" >&2
    exit 1
  fi
}
if [ "$TOP_UP" = 1 ]; then
  top="$CACHE/downloads/top-up"
  rm -rf "$top" && mkdir -p "$top"
  DL="$top" fetch "${ORACLE_DEPS[@]}"
  if ! "${PIP[@]}" install --quiet --no-deps --no-compile --no-index --target "$TARGET" \
        "$top"/*.whl >"$CACHE/pip-install.log" 2>&1; then
    echo "setup_torch_pypi: error: adding ${ORACLE_DEPS[*]} to $TARGET failed;" \
         "see $CACHE/pip-install.log" >&2
    exit 1
  fi
  echo "setup_torch_pypi: added ${ORACLE_DEPS[*]} to $TARGET" >&2
  echo "$TARGET/torch"
  exit 0
fi
echo "setup_torch_pypi: downloading torch==$TORCH_VERSION (LibTorch 2.x, ~540 MB) and" \
     "${#wheels[@]} CUDA library wheel(s) the machine lacks: ${wheels[*]-none}" >&2
fetch "torch==$TORCH_VERSION"
if [ ${#wheels[@]} -gt 0 ]; then fetch "${wheels[@]}"; fi
fetch "${PYTHON_DEPS[@]}" "${ORACLE_DEPS[@]}"

# Install into a fresh folder, then mark it complete (an interrupted run starts over).
rm -rf "$TARGET"
# Every wheel of this version's download folder: torch, the CUDA wheels, the Python dependencies.
files=("$DL"/*.whl)
if ! "${PIP[@]}" install --quiet --no-deps --no-compile --no-index --target "$TARGET" \
      "${files[@]}" >"$CACHE/pip-install.log" 2>&1; then
  echo "setup_torch_pypi: error: installing the wheels into $TARGET failed;" \
       "see $CACHE/pip-install.log" >&2
  tail -n 5 "$CACHE/pip-install.log" >&2
  exit 1
fi
if [ ! -f "$TARGET/torch/share/cmake/Torch/TorchConfig.cmake" ]; then
  echo "setup_torch_pypi: error: $TARGET has no torch/share/cmake/Torch (not a LibTorch wheel?)" >&2
  exit 1
fi
missing=$(LD_LIBRARY_PATH= ldd "$TARGET/torch/lib/libtorch.so" | awk '/not found/ {print $1}' | sort -u)
if [ -n "$missing" ]; then
  echo "setup_torch_pypi: error: LibTorch's libraries need $(echo $missing), found neither on" \
       "this machine nor installed from PyPI" >&2
  exit 1
fi
# A library of the toolkit that is older than the one LibTorch was built against lacks symbols.
undefined=$(LD_LIBRARY_PATH= ldd -r "$TARGET/torch/lib/libtorch_cuda.so" 2>&1 |
            awk '/undefined symbol/ {print $3}' | sort -u | head -n 5)
if [ -n "$undefined" ]; then
  echo "setup_torch_pypi: error: LibTorch's libtorch_cuda.so needs symbols this machine's CUDA" \
       "libraries lack: $(echo $undefined) (an older CUDA toolkit?); remove it from the library" \
       "path or add its wheel to NEEDED_CUDA_LIBS in this script" >&2
  exit 1
fi
touch "$TARGET/.complete"
echo "setup_torch_pypi: LibTorch $TORCH_VERSION in $TARGET/torch" >&2
echo "$TARGET/torch"
