#!/usr/bin/env bash
# `shoal train --strategy ddp` under mpirun: ranks bound to cores of their own (--bind-to core)
# each take the one core of their mask as one intra-op thread and no oversubscription warning is
# printed; ranks that really share the cores (--bind-to none, 2 threads each on 2 cores) are warned
# about, once. Exits 77 (skipped) without mpirun or the dataset, except under
# SHOAL_REQUIRE_ORACLES=1 (CI), where that is a failure.
#   mpirun_binding_test.sh SHOAL_BINARY
set -uo pipefail
SHOAL=${1:?usage: mpirun_binding_test.sh SHOAL_BINARY}
skip() {
  [ "${SHOAL_REQUIRE_ORACLES:-0}" = 1 ] && { echo "mpirun binding: FAILED: $1 (required)"; exit 1; }
  echo "mpirun binding: $1: skipped"; exit 77
}
command -v mpirun >/dev/null || skip "mpirun missing (openmpi-bin)"
[ -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ] || skip "Fashion-MNIST missing"
[ "$(nproc)" -ge 2 ] || skip "fewer than 2 cores: no core of its own for each of 2 ranks"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 SHOAL_LOG_LEVEL=debug
unset RANK WORLD_SIZE MASTER_ADDR MASTER_PORT OMP_NUM_THREADS
TRAIN=(train --strategy ddp --model mlp --epochs 1 --train-samples 1000 --test-samples 200
       --no-progress)
LOG=$(mktemp)
trap 'rm -f "$LOG"' EXIT
failures=0

timeout 120 mpirun --allow-run-as-root -np 2 --bind-to core --mca btl self,vader \
  "$SHOAL" "${TRAIN[@]}" >"$LOG" 2>&1
status=$?
bound=$(grep -c "1 intra-op thread: 1 core in this process's affinity mask, bound" "$LOG")
if [ $status -ne 0 ] || [ "$bound" -ne 2 ] || grep -q oversubscribed "$LOG" ||
   [ "$(grep -c "final test accuracy" "$LOG")" -ne 1 ]; then
  echo "FAIL --bind-to core: exit $status, $bound of 2 ranks bound with 1 thread; output:"
  tail -n 20 "$LOG"
  failures=$((failures + 1))
else
  echo "ok   --bind-to core: one thread per rank, no oversubscription warning"
fi

timeout 120 mpirun --allow-run-as-root -np 2 --bind-to none --mca btl self,vader \
  "$SHOAL" "${TRAIN[@]}" --threads "$(nproc)" >"$LOG" 2>&1
status=$?
warnings=$(grep -c "oversubscribed" "$LOG")
if [ $status -ne 0 ] || [ "$warnings" -ne 1 ]; then
  echo "FAIL --bind-to none --threads $(nproc): exit $status, $warnings warnings (want 0, 1); output:"
  tail -n 20 "$LOG"
  failures=$((failures + 1))
else
  echo "ok   --bind-to none with $(nproc) threads each: warned once ($(grep oversubscribed "$LOG"))"
fi
[ $failures -eq 0 ] || exit 1
