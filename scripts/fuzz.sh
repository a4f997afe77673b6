#!/usr/bin/env bash
# Builds the libFuzzer targets in fuzz/ with clang (build-fuzz/) and runs each for SECONDS
# (default 30), starting from the corpus in fuzz/corpus/<target> when there is one. Exits non-zero
# when a target finds a crash (its reproducer is left in build-fuzz/).
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_EACH=${1:-30}
command -v clang++ >/dev/null || { echo "fuzz: clang++ is missing (apt-get install clang)" >&2; exit 77; }
cmake -S fuzz -B build-fuzz -G Ninja -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build-fuzz -j "${JOBS:-1}"
status=0
for target in fuzz_idx_reader fuzz_unpickler fuzz_zip_directory fuzz_store_wire; do
  corpus=build-fuzz/corpus/$target
  mkdir -p "$corpus"
  [ -d "fuzz/corpus/$target" ] && cp -n fuzz/corpus/$target/* "$corpus"/ 2>/dev/null || true
  echo "fuzz: $target for ${SECONDS_EACH}s"
  if ! (cd build-fuzz && ASAN_OPTIONS=detect_leaks=0 ./$target -max_total_time="$SECONDS_EACH" \
        -rss_limit_mb=1024 -max_len=65536 "corpus/$target" 2>&1 | tail -3); then
    status=1
  fi
done
exit $status
