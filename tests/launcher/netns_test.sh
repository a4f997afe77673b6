#!/usr/bin/env bash
# Real multi-node: two network namespaces (each with its own host name) joined by a veth pair,
# `shoal run --nnodes 2 --nproc-per-node 2` on each, DDP training across them on the hierarchical
# backend (shared memory inside a node, Gloo between nodes), to completion. Then the same job with
# the link cut mid-run: every rank must exit with a clear error within the time-out; none hangs.
# Last, a worker of the other node stopped (SIGSTOP) under a 120 s time-out: the heartbeat names
# it on node 0 in seconds (a stopped process on another host cannot be seen by its process state).
# Exits 77 (skipped) where namespaces cannot be made (not root, no CAP_SYS_ADMIN, no iproute2).
#   netns_test.sh SHOAL_BINARY
set -uo pipefail
SHOAL=${1:?usage: netns_test.sh SHOAL_BINARY}
if [ ! -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ]; then
  # CI installs the dataset: missing there is a failure (SHOAL_REQUIRE_ORACLES=1).
  [ "${SHOAL_REQUIRE_ORACLES:-0}" = 1 ] && { echo "netns: FAILED: Fashion-MNIST missing (required)"; exit 1; }
  echo "netns: Fashion-MNIST missing: skipped"; exit 77
fi
command -v ip >/dev/null && command -v unshare >/dev/null || { echo "netns: ip/unshare missing: skipped"; exit 77; }
TAG=shoal$$
NS0=${TAG}a
NS1=${TAG}b
WORK=$(mktemp -d)
. "$(dirname "$0")/netns_pair.sh"
cleanup() {
  netns_pair_kill "$TAG"
  netns_pair_delete "$TAG"
  rm -rf "$WORK"
}
trap cleanup EXIT
netns_pair_create netns "$TAG" 10.77.0 || exit $?

export SHOAL_AUTH_TOKEN=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')
export SHOAL_TIMEOUT=20s
TRAIN=(train --strategy ddp --backend hierarchical --model mlp --epochs 1 --train-samples 4000
       --test-samples 1000 --batch-size 32 --lr 0.05 --no-progress)
# node NODE_RANK NS IFACE HOSTNAME LOG [extra train args...]
node() {
  local rank=$1 ns=$2 iface=$3 host=$4 log=$5
  shift 5
  ip netns exec "$ns" unshare --uts sh -c 'hostname "$0"; exec "$@"' "$host" \
    env GLOO_SOCKET_IFNAME="$iface" "$SHOAL" run --nnodes 2 --node-rank "$rank" --nproc-per-node 2 \
    --master-addr 10.77.0.1 --master-port 29777 "$SHOAL" "${TRAIN[@]}" "$@" >"$log" 2>&1
}

# wait_within PID SECONDS: PID's exit status, or 124 (after killing it) when it runs longer, so
# that a node that does not end fails this test with a message instead of the CTest time-out.
wait_within() {
  local pid=$1 limit=$2
  for _ in $(seq $((limit * 10))); do
    kill -0 "$pid" 2>/dev/null || { wait "$pid"; return $?; }
    sleep 0.1
  done
  echo "netns: a node did not end within $limit s"
  kill -9 "$pid" 2>/dev/null
  wait "$pid" 2>/dev/null
  return 124
}

# wait_for_training LOG PID: returns once LOG shows a finished epoch (training runs), or fails the
# test when PID ended first or nothing came within 120 s (a loaded machine starts slowly; the
# fault below must hit a running job, not one still starting).
wait_for_training() {
  local log=$1 pid=$2
  for _ in $(seq 1200); do
    grep -q "epoch" "$log" 2>/dev/null && return 0
    kill -0 "$pid" 2>/dev/null || { echo "netns: the job ended before training ran"; tail -20 "$log"; exit 1; }
    sleep 0.1
  done
  echo "netns: no epoch after 120 s"; tail -20 "$log"; exit 1
}

echo "netns: DDP across two namespaces"
start=$(date +%s)
node 0 "$NS0" "${TAG}0" node0 "$WORK/ok0.log" & p0=$!
node 1 "$NS1" "${TAG}1" node1 "$WORK/ok1.log" & p1=$!
wait $p0; s0=$?
wait $p1; s1=$?
echo "netns: nodes exited $s0 and $s1 after $(( $(date +%s) - start )) s"
if [ $s0 -ne 0 ] || [ $s1 -ne 0 ]; then
  echo "--- node 0"; tail -20 "$WORK/ok0.log"; echo "--- node 1"; tail -20 "$WORK/ok1.log"
  exit 1
fi
grep -h "test accuracy\|final" "$WORK/ok0.log" | tail -2

echo "netns: the link cut mid-run"
start=$(date +%s)
node 0 "$NS0" "${TAG}0" node0 "$WORK/cut0.log" --epochs 50 & p0=$!
node 1 "$NS1" "${TAG}1" node1 "$WORK/cut1.log" --epochs 50 & p1=$!
# Cut once training runs, a little into its next epoch.
wait_for_training "$WORK/cut0.log" $p0
sleep 2
ip -n "$NS1" link set "${TAG}1" down
cut=$(date +%s)
wait $p0; s0=$?
wait $p1; s1=$?
took=$(( $(date +%s) - cut ))
echo "netns: after the cut, nodes exited $s0 and $s1 within $took s"
echo "--- node 0"; grep -h "rank" "$WORK/cut0.log" | grep -i "error\|timed out\|failed" | head -4
echo "--- node 1"; grep -h "rank" "$WORK/cut1.log" | grep -i "error\|timed out\|failed" | head -4
[ $s0 -ne 0 ] && [ $s1 -ne 0 ] || { echo "netns: a node succeeded although the link was cut"; exit 1; }
[ $took -le 60 ] || { echo "netns: took $took s, more than the 20 s time-out allows"; exit 1; }
grep -qi "rank" "$WORK/cut0.log" && grep -qi "rank" "$WORK/cut1.log" || exit 1

echo "netns: a worker stopped on the other node"
ip -n "$NS1" link set "${TAG}1" up
SHOAL_TIMEOUT=120s SHOAL_HEARTBEAT_TIMEOUT=5s node 0 "$NS0" "${TAG}0" node0 "$WORK/stop0.log" --epochs 50 & p0=$!
SHOAL_TIMEOUT=120s SHOAL_HEARTBEAT_TIMEOUT=5s node 1 "$NS1" "${TAG}1" node1 "$WORK/stop1.log" --epochs 50 & p1=$!
wait_for_training "$WORK/stop0.log" $p0
sleep 2
# Rank 2: node 1's first worker, its host's leader in the Gloo group between the hosts.
victim=""
for pid in $(ip netns pids "$NS1"); do
  if tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | grep -qx "RANK=2" &&
     tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q " train "; then victim=$pid; fi
done
[ -n "$victim" ] || { echo "netns: rank 2's process not found"; exit 1; }
kill -STOP "$victim"
stopped=$(date +%s)
wait_within $p0 60; s0=$?
took=$(( $(date +%s) - stopped ))
kill -9 "$victim" 2>/dev/null
wait_within $p1 30
echo "netns: node 0 exited $s0 $took s after rank 2 was stopped"
grep -h "heartbeat" "$WORK/stop0.log" | head -2
[ $s0 -ne 0 ] || { echo "netns: node 0 succeeded although rank 2 was stopped"; exit 1; }
[ $took -le 40 ] || { echo "netns: took $took s: the heartbeat (5 s) did not name the stopped rank"; exit 1; }
grep -q "heartbeat has stood still" "$WORK/stop0.log" || { tail -20 "$WORK/stop0.log"; exit 1; }
echo "netns: ok"
