#!/usr/bin/env bash
# Installs, with apt-get, the Debian 12 packages Shoal needs, when they are missing.
# Idempotent and quiet when everything is already there.
#
#   scripts/setup.sh          # building, running and testing (make test)
#   scripts/setup.sh --run    # what building and `make run` need; not the test-only packages
#                             # (PyTorch, SLURM), which a fresh machine spends minutes on
#   scripts/setup.sh --fuzz   # what building needs and clang for the libFuzzer targets
#                             # (scripts/fuzz.sh calls it; `make test` does not need clang)
set -euo pipefail

PACKAGES=(
  cmake ninja-build g++ make ccache pkg-config
  libtorch-dev            # LibTorch 1.13: tensors, autograd, nn, c10d (Gloo)
  libgloo-dev             # Gloo headers used through c10d
  libopenblas0-pthread    # fast BLAS; the reference libblas3 is ~15x slower
  libopenmpi-dev openmpi-bin
  libzmq3-dev cppzmq-dev  # parameter-server transport
  zlib1g-dev
  libdeflate-dev          # fast whole-file gzip inflation for the datasets (optional)
  libpcre2-dev            # GPT-2's pre-tokenizer regex (`shoal data tokenize --encoding gpt2`)
  libpng-dev libjpeg62-turbo-dev  # decoding image folders (ImageFolder)
  libgtest-dev libgmock-dev libbenchmark-dev
  libcli11-dev
  libspdlog-dev           # diagnostics with levels (SHOAL_LOG_LEVEL); brings libfmt-dev
  nlohmann-json3-dev      # metrics and benchmark JSON
  librsvg2-dev libcairo2-dev  # `shoal plot -o run.png` (optional: SHOAL_WITH_PNG)
  dataset-fashion-mnist   # real Fashion-MNIST, gzipped IDX files
  fortunes                # real English text (the fortune databases): token files, the GPT example
)
# Only the tests, benchmarks and fuzzers use these.
TEST_PACKAGES=(
  python3-torch           # PyTorch 1.13: numerical oracle and performance peer
  python3-pil             # writes and decodes the image folders of tests/data/test_image_folder.cpp
  procps                  # ps/pgrep used by process tests
  iproute2                # ip netns: the two-host tests (test_netns, test_slurm_netns); minimal images lack it
  slurm-wlm slurm-client munge  # a real SLURM that tests/launcher/slurm_test.sh starts on loopback
  python3-pip             # installs TEST_PIP_PACKAGES below
)
# Only the fuzzers (CI runs them: scripts/fuzz.sh). ~55 MB to download, ~290 MB installed: kept
# out of `make test`'s set-up, which a fresh machine would otherwise spend the time on.
FUZZ_PACKAGES=(
  clang libclang-rt-14-dev
)
# Test-only Python packages Debian does not have: TensorBoard's own reader and server check the
# event files of `shoal train --tensorboard` (tests/summary/tensorboard_ddp.py). Installed into
# /usr/local for /usr/bin/python3: Debian 12 marks its Python externally managed (PEP 668), so
# pip needs --break-system-packages; what it adds (tensorboard, grpcio, protobuf, werkzeug, ...)
# leaves Debian's python3-torch and numpy as they are. tiktoken is the oracle of GPT-2's BPE
# (tests/data/test_data_tokenize.cpp).
TEST_PIP_PACKAGES=(
  tensorboard
  tiktoken
)

# GPT-2's vocabulary (tiktoken's gpt2.tiktoken: 50,256 ranks) for `shoal data tokenize --encoding
# gpt2` and its test. PyPI ships it in openai-whisper's source archive. pip fetches the archive
# through the machine's own pip set-up (index, mirror, proxy) and checks it against the pinned
# hash before it runs anything of it (pip reads an archive's metadata by running its build
# backend); only the vocabulary file is kept, after its size and checksum are checked.
GPT2_VOCAB="$HOME/.cache/shoal/gpt2.tiktoken"
GPT2_VOCAB_SHA256=306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930
WHISPER_SDIST=openai_whisper-20250625
WHISPER_SDIST_SHA256=37a91a3921809d9f44748ffc73c0a55c9f366c85a3ef5c2ae0cc09540432eb96
sha256_of() { sha256sum <"$1" | cut -d' ' -f1; }
# A subshell: its EXIT trap removes the temporary folder however it ends.
fetch_gpt2_vocab() (
  [ "${1:-}" = "--run" ] || [ "${1:-}" = "--fuzz" ] && exit 0
  [ -s "$GPT2_VOCAB" ] && [ "$(sha256_of "$GPT2_VOCAB")" = "$GPT2_VOCAB_SHA256" ] && exit 0
  echo "setup: fetching GPT-2's vocabulary (gpt2.tiktoken from PyPI's openai-whisper) into $GPT2_VOCAB"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  member="$WHISPER_SDIST/whisper/assets/gpt2.tiktoken"
  echo "openai-whisper==${WHISPER_SDIST#openai_whisper-} --hash=sha256:$WHISPER_SDIST_SHA256" >"$tmp/req.txt"
  if ! /usr/bin/python3 -m pip download -q --no-deps --no-binary :all: --no-build-isolation \
      --require-hashes -r "$tmp/req.txt" -d "$tmp" >/tmp/shoal-setup-vocab.log 2>&1 ||
     [ ! -f "$tmp/$WHISPER_SDIST.tar.gz" ]; then
    echo "setup: error: 'pip download openai-whisper' failed; see /tmp/shoal-setup-vocab.log" >&2
    exit 1
  fi
  size=$(tar -tvzf "$tmp/$WHISPER_SDIST.tar.gz" "$member" 2>/dev/null | awk '{print $3}') || size=
  if [ -z "$size" ] || [ "$size" -gt 4000000 ] ||
     ! tar -xzf "$tmp/$WHISPER_SDIST.tar.gz" -O "$member" >"$tmp/gpt2.tiktoken" 2>/dev/null; then
    echo "setup: error: $WHISPER_SDIST.tar.gz has no readable $member of at most 4 MB" >&2
    exit 1
  fi
  if [ "$(sha256_of "$tmp/gpt2.tiktoken")" != "$GPT2_VOCAB_SHA256" ]; then
    echo "setup: error: $member's checksum is not GPT-2's vocabulary's" >&2
    exit 1
  fi
  mkdir -p "$(dirname "$GPT2_VOCAB")"
  mv "$tmp/gpt2.tiktoken" "$GPT2_VOCAB.tmp" && mv "$GPT2_VOCAB.tmp" "$GPT2_VOCAB"
)

# Installs the missing TEST_PIP_PACKAGES (after apt has installed pip).
install_pip_packages() {
  [ "${1:-}" = "--run" ] || [ "${1:-}" = "--fuzz" ] && return 0
  local missing_pip=()
  for p in "${TEST_PIP_PACKAGES[@]}"; do
    /usr/bin/python3 -c "import $p" 2>/dev/null || missing_pip+=("$p")
  done
  [ ${#missing_pip[@]} -eq 0 ] && return 0
  echo "setup: installing missing Python packages: ${missing_pip[*]}"
  if ! /usr/bin/python3 -m pip install -q --break-system-packages --root-user-action=ignore \
      "${missing_pip[@]}" >/tmp/shoal-setup-pip.log 2>&1; then
    echo "setup: error: 'pip install ${missing_pip[*]}' failed; see /tmp/shoal-setup-pip.log" >&2
    tail -n 20 /tmp/shoal-setup-pip.log >&2
    exit 1
  fi
}

case "${1:-}" in
  --run) ;;
  --fuzz) PACKAGES+=("${FUZZ_PACKAGES[@]}") ;;
  "") PACKAGES+=("${TEST_PACKAGES[@]}") ;;
  *) echo "setup: error: unknown option '$1' (expected --run, --fuzz or nothing)" >&2; exit 2 ;;
esac

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  install_pip_packages "${1:-}"
  fetch_gpt2_vocab "${1:-}"
  exit 0
fi

echo "setup: installing missing packages: ${missing[*]}"
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO=sudo
  else
    echo "setup: error: packages missing (${missing[*]}) and this is not root;" >&2
    echo "setup: run as root, or: sudo apt-get install ${missing[*]}" >&2
    exit 1
  fi
else
  SUDO=
fi

export DEBIAN_FRONTEND=noninteractive
if ! $SUDO apt-get update -qq; then
  echo "setup: error: 'apt-get update' failed (no network or no Debian mirror reachable)." >&2
  echo "setup: install by hand: apt-get install ${missing[*]}" >&2
  exit 1
fi
if ! $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/tmp/shoal-setup-apt.log 2>&1; then
  echo "setup: error: 'apt-get install' failed; see /tmp/shoal-setup-apt.log" >&2
  tail -n 20 /tmp/shoal-setup-apt.log >&2
  exit 1
fi
install_pip_packages "${1:-}"
fetch_gpt2_vocab "${1:-}"
echo "setup: done"
