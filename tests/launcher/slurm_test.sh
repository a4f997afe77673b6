#!/usr/bin/env bash
# Shoal under a real SLURM: munged, slurmctld and slurmd started on loopback (slurm_cluster.sh),
# then, each a job of the cluster:
#   1. `srun -N1 -n2 shoal train --strategy ddp` trains ONE job of world size 2 (one result line),
#      ending with the same weights as `shoal train --strategy ddp --nproc-per-node 2`;
#   2. `srun -n2 shoal train` without --strategy is refused with one line, and trains nothing;
#   3. `srun -n2` of the DDP example, with no MASTER_* set, trains one 2-rank job;
#   4. `sbatch --wait docs/slurm/train.sbatch` trains;
#   5. SIGUSR1 mid-run (as --signal=USR1@90 sends) leaves a checkpoint and exit status 75, and the
#      job submitted again resumes to the weights of an uninterrupted run;
# and no rank warns of oversubscription (srun's shared mask is divided, --cpu-bind=cores is one core
# per rank).
# Exits 77 (skipped) when SLURM, munge or the dataset is missing, except under
# SHOAL_REQUIRE_ORACLES=1 (CI, where scripts/setup.sh installs them), where that is a failure.
#   slurm_test.sh SOURCE_DIR SHOAL_BINARY EXAMPLE_BINARY
set -uo pipefail
SRC=${1:?usage: slurm_test.sh SOURCE_DIR SHOAL_BINARY EXAMPLE_BINARY}
SHOAL=${2:?}
EXAMPLE=${3:?}
skip() {
  if [ "${SHOAL_REQUIRE_ORACLES:-0}" = 1 ]; then
    echo "slurm: FAILED: $1 (SHOAL_REQUIRE_ORACLES=1 forbids skipping)"
    exit 1
  fi
  echo "slurm: $1: skipped"
  exit 77
}
[ -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ] ||
  skip "Fashion-MNIST missing (dataset-fashion-mnist)"
. "$(dirname "$0")/slurm_cluster.sh"
missing=$(slurm_cluster_missing) && skip "$missing is not installed (scripts/setup.sh installs slurm-wlm and munge)"

WORK=$(mktemp -d /tmp/shoal-slurm.XXXXXX)
chmod 755 "$WORK"
cleanup() {
  slurm_cluster_stop
  rm -rf "$WORK"
}
trap cleanup EXIT
slurm_cluster_start "$WORK/cluster"
status=$?
[ $status -eq 77 ] && skip "SLURM is not installed"
[ $status -eq 0 ] || { echo "slurm: FAILED: the cluster did not start"; exit 1; }
echo "slurm: cluster up ($(sinfo -h -o '%P %D %t %C'))"

# Nothing of an outer launcher or an earlier rendezvous may leak into the jobs.
unset MASTER_ADDR MASTER_PORT RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE OMPI_COMM_WORLD_RANK PMI_RANK
export OMP_NUM_THREADS=1 SHOAL_TIMEOUT=60s
failures=0
fail() {
  echo "slurm: FAILED: $1"
  shift
  for log in "$@"; do [ -f "$log" ] && { echo "--- $log"; tail -n 30 "$log"; }; done
  failures=$((failures + 1))
}
TRAIN=(train --model mlp --epochs 1 --train-samples 2000 --test-samples 500 --batch-size 32
       --lr 0.05 --seed 7 --no-progress)

# 1. One DDP job of world size 2 under srun, the same as shoal's own launcher gives.
start=$EPOCHREALTIME
timeout 120 srun -N1 -n2 "$SHOAL" "${TRAIN[@]}" --strategy ddp --dump-parameters "$WORK/srun" \
  >"$WORK/srun.out" 2>"$WORK/srun.err"
status=$?
srun_s=$(awk "BEGIN { printf \"%.1f\", $EPOCHREALTIME - $start }")
results=$(grep -c "final test accuracy" "$WORK/srun.out")
timeout 120 "$SHOAL" "${TRAIN[@]}" --strategy ddp --nproc-per-node 2 \
  --dump-parameters "$WORK/local" >"$WORK/local.out" 2>"$WORK/local.err"
local_status=$?
if [ $status -ne 0 ] || [ "$results" -ne 1 ]; then
  fail "srun -N1 -n2 shoal train --strategy ddp: exit $status, $results result lines (want 0, 1)" \
    "$WORK/srun.out" "$WORK/srun.err"
elif [ $local_status -ne 0 ]; then
  fail "shoal train --strategy ddp --nproc-per-node 2: exit $local_status" "$WORK/local.err"
elif ! cmp -s "$WORK/srun.rank0.pt" "$WORK/local.rank0.pt" ||
     ! cmp -s "$WORK/srun.rank1.pt" "$WORK/local.rank1.pt" ||
     ! cmp -s "$WORK/srun.rank0.pt" "$WORK/srun.rank1.pt"; then
  fail "the final weights under srun differ from shoal's own launcher's (or between ranks)"
  ls -l "$WORK"/*.pt
else
  echo "ok   srun -n2 shoal train --strategy ddp: one job of 2 ranks ($(grep final "$WORK/srun.out")," \
       "$srun_s s), weights equal to --nproc-per-node 2's"
fi
[ -f "$WORK/srun.rank2.pt" ] && fail "a third rank dumped weights: more than one job ran"
grep -q oversubscribed "$WORK/srun.err" && fail "srun -n2 on 2 shared cores warned of oversubscription" "$WORK/srun.err"

# 1b. srun of one task is no rank of a bigger job: shoal train launches its own 2 ranks there.
timeout 120 srun -N1 -n1 "$SHOAL" "${TRAIN[@]}" --strategy ddp --nproc-per-node 2 \
  --dump-parameters "$WORK/one" >"$WORK/one.out" 2>&1
status=$?
if [ $status -ne 0 ] || [ "$(grep -c "final test accuracy" "$WORK/one.out")" -ne 1 ] ||
   ! cmp -s "$WORK/one.rank1.pt" "$WORK/local.rank1.pt"; then
  fail "srun -n1 shoal train --strategy ddp --nproc-per-node 2: exit $status" "$WORK/one.out"
else
  echo "ok   srun -n1 shoal train --strategy ddp --nproc-per-node 2: its own 2 ranks, one job"
fi

# 2. Without a strategy: refused, in one line, nothing trained.
timeout 60 srun -N1 -n2 "$SHOAL" "${TRAIN[@]}" >"$WORK/single.out" 2>"$WORK/single.err"
status=$?
errors=$(grep -c "^shoal: error" "$WORK/single.err")  # srun adds its own per-task lines
if [ $status -eq 0 ] || grep -q "final test accuracy" "$WORK/single.out" || [ "$errors" -ne 1 ] ||
   ! grep -q "started as rank 0 of 2 by slurm.*--strategy ddp" "$WORK/single.err"; then
  fail "srun -n2 shoal train (no strategy): exit $status, $errors error lines (want non-zero, 1)" \
    "$WORK/single.out" "$WORK/single.err"
else
  echo "ok   srun -n2 shoal train without --strategy: refused ($(grep "^shoal: error" "$WORK/single.err"))"
fi

# 3. The DDP example, a user's own program, with nothing set by hand.
timeout 120 srun -N1 -n2 "$EXAMPLE" 1 >"$WORK/example.out" 2>"$WORK/example.err"
status=$?
if [ $status -ne 0 ] || [ "$(grep -c "(2 ranks x" "$WORK/example.out")" -ne 1 ]; then
  fail "srun -n2 example_ddp_fashion_mnist: exit $status" "$WORK/example.out" "$WORK/example.err"
else
  echo "ok   srun -n2 example_ddp_fashion_mnist: $(cat "$WORK/example.out")"
fi

# 4. The documented batch script, as a user submits it.
mkdir -p "$WORK/batch"
(cd "$WORK/batch" && SHOAL="$SHOAL" timeout 150 sbatch --wait --quiet "$SRC/docs/slurm/train.sbatch" \
   "${TRAIN[@]:1}" >"$WORK/sbatch.log" 2>&1)
status=$?
out=$(ls "$WORK"/batch/shoal-ddp-*.out 2>/dev/null | head -n 1)
if [ $status -ne 0 ] || [ -z "$out" ] || [ "$(grep -c "final test accuracy" "$out")" -ne 1 ] ||
   ! compgen -G "$WORK/batch/checkpoints/*/*" >/dev/null; then
  fail "sbatch --wait docs/slurm/train.sbatch: exit $status" "$WORK/sbatch.log" "$out"
else
  echo "ok   sbatch --wait docs/slurm/train.sbatch: $(grep "final test accuracy" "$out")"
  # Its srun binds each rank to a core (--cpu-bind=cores): no warning.
  grep -q oversubscribed "$out" && fail "srun --cpu-bind=cores warned of oversubscription" "$out"
fi

# 5. Preemption: SIGUSR1 to the job's ranks mid-run (what --signal=USR1@90 sends) leaves a
# checkpoint and exit status 75; the job submitted again with the same CKPT resumes and ends with
# the weights of an uninterrupted run.
PRE=(--model mlp --epochs 3 --train-samples 8000 --test-samples 500 --batch-size 32 --lr 0.05
     --seed 3 --no-progress)
timeout 120 srun -N1 -n2 --cpu-bind=cores "$SHOAL" train --strategy ddp "${PRE[@]}" \
  --dump-parameters "$WORK/whole" >"$WORK/whole.out" 2>&1 ||
  fail "srun of the uninterrupted run: exit $?" "$WORK/whole.out"
mkdir -p "$WORK/pre"
{
  (cd "$WORK/pre" && CKPT="$WORK/pre/ckpt" SHOAL_REQUEUE=0 SHOAL="$SHOAL" timeout 150 \
     sbatch --parsable --wait "$SRC/docs/slurm/train.sbatch" "${PRE[@]}" --checkpoint-every 20 \
     --dump-parameters "$WORK/pre/cut" >"$WORK/pre/job" 2>"$WORK/pre/sbatch.err")
  echo $? >"$WORK/pre/status"
} &
waiter=$!
# Signal once training runs: the first checkpoint is there.
if slurm_wait 60 sh -c "ls '$WORK'/pre/ckpt/*.pt"; then
  scancel --signal=USR1 "$(cat "$WORK/pre/job")"
else
  fail "no checkpoint within 60 s of submitting the job to preempt" "$WORK/pre/sbatch.err"
fi
wait $waiter
status=$(cat "$WORK/pre/status")
out=$(ls "$WORK"/pre/shoal-ddp-*.out 2>/dev/null | head -n 1)
if [ "$status" != 75 ] || ! grep -q "preemption warning" "$out" || [ -e "$WORK/pre/cut.rank0.pt" ]; then
  fail "SIGUSR1: job exit $status (want 75 with a checkpoint, before the end)" "$out"
else
  echo "ok   SIGUSR1 mid-run: exit 75, $(grep -o "stopped after step [0-9]*" "$out")"
  rm -f "$out"
  (cd "$WORK/pre" && CKPT="$WORK/pre/ckpt" SHOAL="$SHOAL" timeout 150 sbatch --wait --quiet \
     "$SRC/docs/slurm/train.sbatch" "${PRE[@]}" --dump-parameters "$WORK/pre/resumed" \
     >"$WORK/pre/sbatch2.err" 2>&1)
  status=$?
  out=$(ls "$WORK"/pre/shoal-ddp-*.out 2>/dev/null | head -n 1)
  if [ $status -ne 0 ] || ! grep -q "resumed from" "$out" ||
     ! cmp -s "$WORK/whole.rank0.pt" "$WORK/pre/resumed.rank0.pt" ||
     ! cmp -s "$WORK/whole.rank1.pt" "$WORK/pre/resumed.rank1.pt"; then
    fail "the re-submitted job: exit $status, or not resumed, or weights unlike the uninterrupted run's" \
      "$out" "$WORK/pre/sbatch2.err"
  else
    echo "ok   re-submitted: resumed, final weights equal to an uninterrupted run's"
  fi
fi

if [ $failures -ne 0 ]; then
  slurm_cluster_logs
  echo "slurm: $failures case(s) failed"
  exit 1
fi
echo "slurm: all cases passed"
