#!/usr/bin/env bash
# Builds the libFuzzer targets in fuzz/ with clang (build-fuzz/) and runs each for SECONDS
# (default 30), starting from its seed corpus in fuzz/corpus/<target>. Exits non-zero when a
# target finds a crash, a leak of its limits or a time-out (its reproducer, crash-*, is left in
# build-fuzz/ and its last lines are printed).
#
#   scripts/fuzz.sh [SECONDS]       build and run every target (CI: .ci/run, 20 s each)
#   scripts/fuzz.sh --make-corpus   rewrite fuzz/corpus/ with Shoal's own encoders
set -euo pipefail
cd "$(dirname "$0")/.."
TARGETS=(fuzz_idx_reader fuzz_unpickler fuzz_zip_directory fuzz_checksum_manifest fuzz_store_wire
         fuzz_ps_message fuzz_stage_header fuzz_image_decode fuzz_gpt2_vocab)
if ! command -v clang++ >/dev/null; then
  bash scripts/setup.sh --fuzz
  command -v clang++ >/dev/null || { echo "fuzz: clang++ is missing (apt-get install clang libclang-rt-14-dev)" >&2; exit 77; }
fi
start=$SECONDS
# Paths under the checkout are hashed relative to it: another clone (CI's) reuses the objects.
export CCACHE_BASEDIR="$PWD"
cmake -S fuzz -B build-fuzz -G Ninja -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=RelWithDebInfo \
      -DCMAKE_CXX_COMPILER_LAUNCHER="$(command -v ccache || true)" >/dev/null
if [ "${1:-}" = --make-corpus ]; then
  cmake --build build-fuzz -j "${JOBS:-2}" --target make_corpus
  rm -rf fuzz/corpus && build-fuzz/make_corpus fuzz/corpus
  find fuzz/corpus -type f | sort
  exit 0
fi
SECONDS_EACH=${1:-30}
cmake --build build-fuzz -j "${JOBS:-2}" --target "${TARGETS[@]}"
echo "fuzz: built in $((SECONDS - start)) s"
status=0
for target in "${TARGETS[@]}"; do
  # The seeds are copied: libFuzzer adds what it finds to the first corpus directory.
  corpus=build-fuzz/corpus/$target
  mkdir -p "$corpus"
  [ -d "fuzz/corpus/$target" ] && cp -n fuzz/corpus/$target/* "$corpus"/ 2>/dev/null || true
  log=build-fuzz/$target.log
  # An image may legitimately decode to 64 Mpixel (192 MiB of pixels, plus the decoders' buffers
  # and ASan's shadow): its target measured 852 MB at peak, too near 1024 to leave headroom.
  rss_limit=1024
  [ "$target" = fuzz_image_decode ] && rss_limit=2048
  if (cd build-fuzz && ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1 ./$target \
        -max_total_time="$SECONDS_EACH" -rss_limit_mb="$rss_limit" -timeout=10 -max_len=65536 \
        -print_final_stats=1 "corpus/$target" >"$target.log" 2>&1); then
    echo "fuzz: $target: $(grep -m1 -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$') runs in ${SECONDS_EACH} s, no crash"
  else
    status=1
    echo "fuzz: $target FAILED; the last lines of $log:" >&2
    tail -n 40 "$log" >&2
  fi
done
echo "fuzz: $([ $status = 0 ] && echo passed || echo FAILED) in $((SECONDS - start)) s"
exit $status
