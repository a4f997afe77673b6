#!/usr/bin/env bash
# Allreduce on one host: Shoal's shm and gloo backends (with one-thread memcpy) and OpenMPI,
# interleaved A B A B, medians over the rounds, ratios; the table of docs/PERFORMANCE.md.
#
#   bench/compare_allreduce.sh [BUILD_DIR=build] [ROUNDS=5] [RANKS=2]
set -euo pipefail
build=${1:-build}
rounds=${2:-5}
ranks=${3:-2}
out=$(mktemp /tmp/shoal-allreduce-XXXXXX.jsonl)
for ((i = 0; i < rounds; i++)); do
  "$build/bench/shm_allreduce_bench" --ranks "$ranks" --rounds 1 --json >>"$out"
  if [[ -x "$build/bench/mpi_allreduce_bench" ]]; then
    mpirun --allow-run-as-root --oversubscribe -np "$ranks" \
      "$build/bench/mpi_allreduce_bench" 1 >>"$out"
  fi
done
/usr/bin/python3 - "$out" "$ranks" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
ranks = int(sys.argv[2])
memcpy = statistics.median(r["bandwidth"] for r in rows if r["op"] == "memcpy")
t = {}
for r in rows:
    if r["op"] == "allreduce":
        t.setdefault((r["backend"], r["bytes"]), []).append(r["seconds"])
med = {k: statistics.median(v) for k, v in t.items()}
bus = lambda b, s: b * 2 * (ranks - 1) / ranks / s / 1e9
print(f"memcpy, one thread, 64 MiB: {memcpy/1e9:.2f} GB/s; {ranks} ranks; medians of {len(t[next(iter(t))])} rounds")
print("| size | shm µs | shm busbw GB/s | % memcpy | OpenMPI µs | OpenMPI busbw | shm/MPI | Gloo µs | Gloo busbw | shm/Gloo |")
print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for b in sorted({k[1] for k in med}):
    s = med.get(("shm", b)); m = med.get(("openmpi", b)); g = med.get(("gloo", b))
    size = f"{b>>20} MiB" if b >= 1 << 20 else f"{b>>10} KiB"
    cell = lambda x: f"{x*1e6:.1f} | {bus(b, x):.2f}" if x else "- | -"
    ratio = lambda x: f"{x/s:.2f}×" if x and s else "-"
    print(f"| {size} | {cell(s)} | {100*bus(b, s)*1e9/memcpy:.0f} % | {cell(m)} | {ratio(m)} | {cell(g)} | {ratio(g)} |")
PY
echo "raw results: $out"
