#!/usr/bin/env bash
# Two SLURM nodes in two network namespaces (each with its own host name, and an /etc/hosts of the
# test's own bind-mounted in its mount namespace), joined by a veth pair: slurmctld and the first
# slurmd in one, the second slurmd in the other, munged shared through its socket file. Then
# `srun -N2 --ntasks-per-node=1 shoal train --strategy ddp` trains ONE job across them, the
# rendezvous at the first node of the step (nothing set by hand), to the weights of
# `shoal train --strategy ddp --nproc-per-node 2` on one host; and `sbatch --nodes=2` of
# docs/slurm/train.sbatch does the same.
# Exits 77 (skipped) where namespaces cannot be made or SLURM is missing, except that a missing
# SLURM or dataset under SHOAL_REQUIRE_ORACLES=1 (CI) fails.
#   slurm_netns_test.sh SHOAL_BINARY
set -uo pipefail
SHOAL=${1:?usage: slurm_netns_test.sh SHOAL_BINARY}
required_skip() {
  [ "${SHOAL_REQUIRE_ORACLES:-0}" = 1 ] && { echo "slurm netns: FAILED: $1 (required)"; exit 1; }
  echo "slurm netns: $1: skipped"; exit 77
}
[ -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ] || required_skip "Fashion-MNIST missing"
. "$(dirname "$0")/slurm_cluster.sh"
missing=$(slurm_cluster_missing) && required_skip "$missing is not installed (scripts/setup.sh)"
export PATH="$PATH:/usr/sbin"
command -v ip >/dev/null && command -v unshare >/dev/null && command -v nsenter >/dev/null || { echo "slurm netns: ip/unshare missing: skipped"; exit 77; }

TAG=shs$$
NS0=${TAG}a
NS1=${TAG}b
WORK=$(mktemp -d /tmp/shoal-slurm-netns.XXXXXX)
chmod 755 "$WORK"
. "$(dirname "$0")/netns_pair.sh"
cleanup() {
  netns_pair_kill "$TAG"
  [ -f "$WORK/munge/munged.pid" ] && kill "$(cat "$WORK/munge/munged.pid")" 2>/dev/null
  sleep 0.2
  netns_pair_delete "$TAG"
  rm -rf "$WORK"
}
trap cleanup EXIT
netns_pair_create "slurm netns" "$TAG" 10.78.0 || exit $?
printf '127.0.0.1 localhost\n10.78.0.1 snode0\n10.78.0.2 snode1\n' >"$WORK/hosts"

# on NS HOST COMMAND...: runs COMMAND as host HOST inside NS, with the test's /etc/hosts.
on() {
  local ns=$1 host=$2
  shift 2
  # nsenter, not `ip netns exec`: that mounts a fresh /sys, without the cgroup tree slurmd reads.
  nsenter --net="/run/netns/$ns" unshare --mount --uts sh -c \
    'mount --bind "$0" /etc/hosts && hostname "$1" && shift && exec "$@"' "$WORK/hosts" "$host" "$@"
}

mkdir -p "$WORK/state" "$WORK/spool/snode0" "$WORK/spool/snode1"
slurm_reaper_start "$WORK" "$NS0" "$NS1"
slurm_munged_start "$WORK" || { echo "slurm netns: munged did not start"; exit 1; }
slurm_conf_write "$WORK" shoalnetns "snode0(10.78.0.1)" 6817 6818 -%n \
  "NodeName=snode0 NodeAddr=10.78.0.1 CPUs=2 State=UNKNOWN" \
  "NodeName=snode1 NodeAddr=10.78.0.2 CPUs=2 State=UNKNOWN" \
  "PartitionName=debug Nodes=snode[0-1] Default=YES MaxTime=INFINITE State=UP"
export SLURM_CONF=$WORK/slurm.conf
logs() {
  for log in "$WORK"/slurmctld.log "$WORK"/slurmd-*.log; do
    [ -f "$log" ] && { echo "--- $log"; tail -n 20 "$log"; }
  done
}
on "$NS0" snode0 slurmctld -c -f "$SLURM_CONF" || { echo "slurm netns: slurmctld did not start"; logs; exit 1; }
on "$NS0" snode0 slurmd -N snode0 -f "$SLURM_CONF" || { echo "slurm netns: slurmd 0 did not start"; logs; exit 1; }
on "$NS1" snode1 slurmd -N snode1 -f "$SLURM_CONF" || { echo "slurm netns: slurmd 1 did not start"; logs; exit 1; }
if ! slurm_wait 60 sh -c "[ \"\$(ip netns exec $NS0 sinfo -h -N -o %t | grep -cx idle)\" = 2 ]"; then
  echo "slurm netns: the two nodes are not idle within 60 s: $(ip netns exec "$NS0" sinfo -h -N -o '%N %t %E')"
  logs
  exit 1
fi
echo "slurm netns: nodes up: $(ip netns exec "$NS0" sinfo -h -N -o '%N:%t' | tr '\n' ' ')"

unset MASTER_ADDR MASTER_PORT RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE OMPI_COMM_WORLD_RANK PMI_RANK
export OMP_NUM_THREADS=1 SHOAL_TIMEOUT=60s
export SHOAL_AUTH_TOKEN=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')
TRAIN=(train --strategy ddp --model mlp --epochs 1 --train-samples 2000 --test-samples 500
       --batch-size 32 --lr 0.05 --seed 7 --no-progress)
# The two tasks run on the two nodes, each in its own namespace.
hosts=$(on "$NS0" snode0 timeout 60 srun -N2 --ntasks-per-node=1 sh -c 'echo "$SLURM_PROCID $(hostname)"' | sort | tr '\n' ' ')
[ "$hosts" = "0 snode0 1 snode1 " ] || { echo "slurm netns: FAILED: tasks ran on '$hosts'"; logs; exit 1; }
start=$EPOCHREALTIME
SHOAL_LOG_LEVEL=debug on "$NS0" snode0 timeout 150 srun -N2 --ntasks-per-node=1 "$SHOAL" "${TRAIN[@]}" \
  --dump-parameters "$WORK/netns" >"$WORK/srun.out" 2>"$WORK/srun.err"
status=$?
took=$(awk "BEGIN { printf \"%.1f\", $EPOCHREALTIME - $start }")
timeout 120 "$SHOAL" "${TRAIN[@]}" --nproc-per-node 2 --dump-parameters "$WORK/local" \
  >"$WORK/local.out" 2>&1 || { echo "slurm netns: the one-host run failed"; tail "$WORK/local.out"; exit 1; }
results=$(grep -c "final test accuracy" "$WORK/srun.out")
if [ $status -ne 0 ] || [ "$results" -ne 1 ]; then
  echo "slurm netns: FAILED: srun -N2 exit $status, $results result lines (want 0, 1)"
  cat "$WORK/srun.out" "$WORK/srun.err" | tail -n 30
  logs
  exit 1
fi
# Each rank took its place from SLURM and met the other across the link (hierarchical: two hosts).
if [ "$(grep -c "rank information from slurm" "$WORK/srun.err")" -ne 2 ] ||
   [ "$(grep -c "init_process_group: backend hierarchical" "$WORK/srun.err")" -ne 2 ]; then
  echo "slurm netns: FAILED: the ranks did not both start from SLURM on the hierarchical backend"
  grep init_process_group "$WORK/srun.err"
  exit 1
fi
if ! cmp -s "$WORK/netns.rank0.pt" "$WORK/local.rank0.pt" ||
   ! cmp -s "$WORK/netns.rank1.pt" "$WORK/local.rank1.pt"; then
  echo "slurm netns: FAILED: the two-node weights differ from the one-host run's"
  ls -l "$WORK"/*.pt
  exit 1
fi
echo "ok   srun -N2 --ntasks-per-node=1 across two namespaces: one job ($(grep final "$WORK/srun.out"), $took s), weights equal to one host's"

# One `shoal run` per node under srun: nodes, node rank and master from SLURM, 2 workers on each.
on "$NS0" snode0 timeout 150 srun -N2 --ntasks-per-node=1 "$SHOAL" run --nproc-per-node 2 \
  "$SHOAL" "${TRAIN[@]}" --dump-parameters "$WORK/agents" >"$WORK/agents.out" 2>&1
status=$?
if [ $status -ne 0 ] || [ "$(grep -c "final test accuracy" "$WORK/agents.out")" -ne 1 ] ||
   [ "$(ls "$WORK"/agents.rank*.pt 2>/dev/null | wc -l)" -ne 4 ] ||
   ! cmp -s "$WORK/agents.rank0.pt" "$WORK/agents.rank3.pt"; then
  echo "slurm netns: FAILED: srun -N2 shoal run --nproc-per-node 2: exit $status, want one 4-rank job"
  tail -n 30 "$WORK/agents.out"
  exit 1
fi
echo "ok   srun -N2 --ntasks-per-node=1 shoal run --nproc-per-node 2: one job of 4 ranks on 2 nodes ($(grep -o "final test accuracy.*" "$WORK/agents.out"))"

# The documented batch script on two nodes: sbatch --nodes=2 --ntasks-per-node=1.
SBATCH_SCRIPT="$(cd "$(dirname "$0")/../.." && pwd)/docs/slurm/train.sbatch"
mkdir -p "$WORK/batch"
(cd "$WORK/batch" && SHOAL="$SHOAL" on "$NS0" snode0 timeout 150 sbatch --wait --quiet --nodes=2 \
   --ntasks-per-node=1 "$SBATCH_SCRIPT" "${TRAIN[@]:1}" --dump-parameters "$WORK/batch/final" \
   >"$WORK/sbatch.log" 2>&1)
status=$?
out=$(ls "$WORK"/batch/shoal-ddp-*.out 2>/dev/null | head -n 1)
if [ $status -ne 0 ] || [ -z "$out" ] || [ "$(grep -c "final test accuracy" "$out")" -ne 1 ] ||
   ! cmp -s "$WORK/batch/final.rank1.pt" "$WORK/local.rank1.pt"; then
  echo "slurm netns: FAILED: sbatch --nodes=2 docs/slurm/train.sbatch: exit $status"
  cat "$WORK/sbatch.log" "$out" 2>/dev/null | tail -n 20
  logs
  exit 1
fi
echo "ok   sbatch --nodes=2 --ntasks-per-node=1 docs/slurm/train.sbatch: $(grep final "$out"), weights equal to one host's"

