#!/usr/bin/env bash
# Eight nodes, each a network namespace with its own host name, behind one router that limits
# each node to 10 Gbit/s and holds every packet 100 µs (netns_cluster.sh). First the added delay
# is checked: a round trip between two nodes takes at least the 200 µs it must. Then DDP runs
# across the eight nodes (`shoal run --nnodes 8`, one worker each) on the hierarchical backend
# with the allreduce algorithm chosen per call (SHOAL_ALLREDUCE_ALGO=auto), and must end as the
# same job on one host does: every node exits 0 with the one-host run's test accuracy.
# Exits 77 (skipped) where namespaces cannot be made (not root, no iproute2, no TUN).
#   netns_cluster_test.sh SHOAL_BINARY
set -uo pipefail
SHOAL=${1:?usage: netns_cluster_test.sh SHOAL_BINARY}
HERE=$(cd "$(dirname "$0")" && pwd)
if [ ! -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ]; then
  [ "${SHOAL_REQUIRE_ORACLES:-0}" = 1 ] && { echo "netns8: FAILED: Fashion-MNIST missing (required)"; exit 1; }
  echo "netns8: Fashion-MNIST missing: skipped"; exit 77
fi
command -v ip >/dev/null && command -v unshare >/dev/null || { echo "netns8: ip/unshare missing: skipped"; exit 77; }
NODES=8
DELAY_US=100
DEADLINE_S=240  # below CTest's TIMEOUT (300), which would kill this script before its clean-up
TAG=sc$$
WORK=$(mktemp -d)
. "$HERE/netns_cluster.sh"
cleanup() {
  trap - EXIT INT TERM
  [ -n "${WATCHDOG:-}" ] && kill "$WATCHDOG" 2>/dev/null
  netns_cluster_kill "$TAG" "$NODES"
  netns_cluster_delete "$TAG" "$NODES"
  rm -rf "$WORK"
}
trap cleanup EXIT
trap 'echo "netns8: stopped (past ${DEADLINE_S} s, or interrupted)"; exit 1' INT TERM
# Its output goes nowhere: a sleep left holding this script's stdout would keep CTest waiting.
( exec >/dev/null 2>&1; sleep "$DEADLINE_S"; kill -TERM $$ ) & WATCHDOG=$!
netns_cluster_create netns8 "$TAG" "$NODES" 10gbit "$DELAY_US" || exit $?

# rtt NODE HOST SERVER_NS: the median round trip from NODE to a server at HOST in SERVER_NS, in µs.
rtt() {
  ip netns exec "$3" timeout 60 /usr/bin/python3 "$HERE/rtt_probe.py" serve 7007 & local server=$!
  ip netns exec "${TAG}n$1" timeout 60 /usr/bin/python3 "$HERE/rtt_probe.py" probe "$2" 7007 100
  wait $server
}
echo "netns8: the router adds $DELAY_US µs each way"
base=$(rtt 5 10.79.5.1 "${TAG}r") || exit 1    # to the router itself: no relay
relayed=$(rtt 5 10.79.0.2 "${TAG}n0") || exit 1  # to node 0: through the relay both ways
echo "netns8: median round trip node 5 -> router $base µs, node 5 -> node 0 $relayed µs"
kill -0 "$NETNS_CLUSTER_RELAY" 2>/dev/null || { echo "netns8: the delay relay is not running"; exit 1; }
[ "$relayed" -ge $((base + 2 * DELAY_US)) ] ||
  { echo "netns8: the delay is missing ($relayed < $base + $((2 * DELAY_US)) µs)"; exit 1; }

export SHOAL_AUTH_TOKEN=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')
export SHOAL_TIMEOUT=60s
TRAIN=(train --strategy ddp --model mlp --epochs 1 --train-samples 2000 --test-samples 500
       --batch-size 16 --lr 0.05 --seed 5 --no-progress)
accuracy() { sed -n 's/.*final test accuracy: \([0-9.]*\).*/\1/p' "$1" | tail -1; }

echo "netns8: the same job on one host"
timeout 120 "$SHOAL" "${TRAIN[@]}" --nproc-per-node "$NODES" --backend gloo >"$WORK/host.log" 2>&1 ||
  { tail -20 "$WORK/host.log"; exit 1; }
expected=$(accuracy "$WORK/host.log")

echo "netns8: DDP across $NODES namespaced nodes"
start=$(date +%s)
pids=()
for i in $(seq 0 $((NODES - 1))); do
  ip netns exec "${TAG}n$i" unshare --uts sh -c 'hostname "$0"; exec "$@"' "node$i" \
    env GLOO_SOCKET_IFNAME="${TAG}n$i" SHOAL_ALLREDUCE_ALGO=auto \
    timeout 150 "$SHOAL" run --nnodes "$NODES" --node-rank "$i" --nproc-per-node 1 \
    --master-addr 10.79.0.2 --master-port 29779 "$SHOAL" "${TRAIN[@]}" --backend hierarchical \
    >"$WORK/node$i.log" 2>&1 &
  pids+=($!)
done
failed=0
for i in "${!pids[@]}"; do
  wait "${pids[$i]}" || { echo "--- node $i failed"; tail -15 "$WORK/node$i.log"; failed=1; }
done
echo "netns8: $NODES nodes done in $(( $(date +%s) - start )) s"
[ $failed -eq 0 ] || exit 1
got=$(accuracy "$WORK/node0.log")
echo "netns8: test accuracy $got across the nodes, $expected on one host"
[ -n "$got" ] && [ "$got" = "$expected" ] || { echo "netns8: the accuracies differ"; exit 1; }
echo "netns8: ok"
