#!/usr/bin/env bash
# Elastic membership across network namespaces: `shoal run --nnodes 1:3 --fault-tolerant` DDP
# training. Node 0 (its own namespace) starts the job alone; nodes 1 and 2 (a second namespace)
# join the running job one after the other, each at a step boundary from a live peer; then node
# 2's shoal run is killed (SIGKILL) and the other two finish the epoch. Checks the world sizes the
# job went through (node 0's log), every sample of the epoch trained once in a committed step, and
# the survivors' weights identical. Every wait is on a condition (a log line, a count of committed
# steps) with a deadline. While nodes 0 and 1 train, a second shoal run of node 1 is refused in one
# line and changes nothing. The whole script ends within DEADLINE seconds, below its CTest TIMEOUT:
# a watchdog TERMs it and every node runs under `timeout`, so that its namespaces are always
# removed (CTest's SIGKILL at the TIMEOUT would skip the EXIT trap).
# Exits 77 (skipped) where namespaces cannot be made (not root, no CAP_SYS_ADMIN, no iproute2).
#   elastic_netns_test.sh SHOAL_BINARY
set -uo pipefail
SHOAL=${1:?usage: elastic_netns_test.sh SHOAL_BINARY}
if [ ! -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ]; then
  [ "${SHOAL_REQUIRE_ORACLES:-0}" = 1 ] && { echo "elastic: FAILED: Fashion-MNIST missing (required)"; exit 1; }
  echo "elastic: Fashion-MNIST missing: skipped"; exit 77
fi
command -v ip >/dev/null || { echo "elastic: ip missing: skipped"; exit 77; }
DEADLINE=${ELASTIC_DEADLINE:-220}  # seconds; CTest's TIMEOUT is 240
TAG=shel$$
WORK=$(mktemp -d)
. "$(dirname "$0")/netns_pair.sh"
watchdog() {
  sleep "$DEADLINE" & local pause=$!
  trap 'kill "$pause" 2>/dev/null; exit 0' TERM
  wait "$pause" && kill -TERM $$
}
watchdog & watchdog_pid=$!
cleanup() {
  kill "$watchdog_pid" 2>/dev/null
  netns_pair_kill "$TAG"
  netns_pair_delete "$TAG"
  rm -rf "$WORK"
}
trap cleanup EXIT
trap 'echo "elastic: FAILED: not done within $DEADLINE s (ELASTIC_DEADLINE)"; exit 1' INT TERM
netns_pair_create elastic "$TAG" 10.78.0 || exit $?

export SHOAL_AUTH_TOKEN=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')
# A survivor waits for a dead node's vote until its heartbeat stands still (2 s), and for a peer
# whose collective failed first up to the collective time-out.
export SHOAL_TIMEOUT=10s SHOAL_HEARTBEAT_TIMEOUT=2s OMP_NUM_THREADS=1
export SHOAL_FT_SAMPLE_LOG=$WORK/samples
SAMPLES=${ELASTIC_SAMPLES:-1200}
TRAIN=(train --strategy ddp --model mlp --epochs 1 --train-samples "$SAMPLES" --test-samples 200
       --batch-size 10 --no-progress --fault-tolerant --min-replicas 1
       --dump-parameters "$WORK/weights")
# node NODE_RANK NAMESPACE INTERFACE [LOG]: one node's shoal run under `timeout` (exec'd: $! is
# timeout's pid, and shoal run is its child).
node() {
  exec ip netns exec "$2" env GLOO_SOCKET_IFNAME="$3" timeout -k 5 "$DEADLINE" "$SHOAL" run \
    --nnodes 1:3 --node-rank "$1" --nproc-per-node 1 --rdzv-backend c10d \
    --rdzv-endpoint 10.78.0.1:29778 --rdzv-conf last_call_timeout=0 "$SHOAL" "${TRAIN[@]}" \
    >"${4:-$WORK/node$1.log}" 2>&1
}
child_of() { tr -d " \n" < "/proc/$1/task/$1/children"; }
fail() {
  echo "elastic: FAILED: $*"
  for n in 0 1 2; do echo "--- node $n"; tail -15 "$WORK/node$n.log" 2>/dev/null; done
  exit 1
}
# within SECONDS WHAT COMMAND...: waits until COMMAND succeeds, or fails the test.
within() {
  local limit=$1 what=$2
  shift 2
  for _ in $(seq $((limit * 20))); do
    "$@" && return 0
    kill -0 "$p0" 2>/dev/null || fail "node 0 ended while waiting for $what"
    sleep 0.05
  done
  fail "no $what within $limit s"
}
commits() {
  local n
  n=$(grep -c '^C' "$WORK/samples.rank$1" 2>/dev/null)
  echo "${n:-0}"
}
committed() { [ "$(commits "$1")" -ge "$2" ]; }
# regrouped N TIMES: node 0's log shows a world of N replicas formed TIMES times.
regrouped() {
  [ "$(grep -c "goes on with $1 replicas" "$WORK/node0.log")" -ge "$2" ]
}
wait_exit() {
  local pid=$1
  for _ in $(seq $((DEADLINE * 20))); do
    kill -0 "$pid" 2>/dev/null || { wait "$pid"; return $?; }
    sleep 0.05
  done
  kill -9 "$pid" 2>/dev/null
  return 124
}

start=$(date +%s)
node 0 "${TAG}a" "${TAG}0" & p0=$!
within 90 "steps of node 0 alone" committed 0 5
# Node 0's worker waits, stopped, while node 1 starts, so that the epoch is not spent before the
# others come, however fast this machine trains (with no other replica, no one waits for it).
worker0=$(child_of "$(child_of "$p0")")
kill -STOP "$worker0"
node 1 "${TAG}b" "${TAG}1" & p1=$!
within 90 "node 1 asking to join" grep -q "asks to join" "$WORK/node1.log"
kill -CONT "$worker0"
within 90 "node 1 joining" regrouped 2 1
within 60 "steps of node 1" committed 1 3
# Node 1 started twice: refused while node 1 trains (node 2 joins meanwhile).
node 1 "${TAG}b" "${TAG}1" "$WORK/twice.log" & twice=$!
node 2 "${TAG}b" "${TAG}1" & p2=$!
within 90 "node 2 joining" regrouped 3 1
wait_exit "$twice"; s_twice=$?
[ "$s_twice" -ne 0 ] && [ "$s_twice" -ne 124 ] && [ "$(wc -l < "$WORK/twice.log")" -eq 1 ] &&
  grep -q "node rank 1 is already running in this job" "$WORK/twice.log" ||
  fail "a second node 1 exited $s_twice, not refused in one line: $(head -5 "$WORK/twice.log")"
within 60 "steps of node 2" committed 2 2
kill -9 "$(child_of "$p2")"
wait "$p2" 2>/dev/null
within 60 "the world shrinking back to 2" regrouped 2 2
wait_exit "$p0"; s0=$?
wait_exit "$p1"; s1=$?
echo "elastic: nodes 0 and 1 exited $s0 and $s1 after $(( $(date +%s) - start )) s"
[ "$s0" -eq 0 ] && [ "$s1" -eq 0 ] || fail "a surviving node failed"
grep -q "the job started with node 0 (--nnodes 1:3); node 0 is one of them" "$WORK/node0.log" ||
  fail "node 0 did not start the job alone"
grep -q "node 2 joins the running job" "$WORK/node2.log" || fail "node 2 did not join as a late node"

# The world sizes over time, as node 0 saw its generations form: 1 (the start), 2, 3, 2.
sizes=$(grep -o "goes on with [0-9]* replica" "$WORK/node0.log" | awk '{print $4}' | tr '\n' ' ')
per_generation=$(awk '$1 == "C" { ++n[$2] } END { for (g = 0; g in n; ++g) printf "%d ", n[g] }' "$WORK/samples.rank0")
echo "elastic: world sizes after the start: $sizes; node 0's steps per generation: $per_generation"
[ "$sizes" = "2 3 2 " ] || fail "world sizes after the start were '$sizes', not '2 3 2 '"
grep -q "received the state of rank" "$WORK/node2.log" || fail "node 2 did not receive a peer's state"

# Every sample of the epoch trained once, in steps some replica committed ("C generation
# attempt"; "T epoch generation attempt ids...": what a replica trained in that attempt).
counts=$(cat "$WORK"/samples.rank0 "$WORK"/samples.rank1 "$WORK"/samples.rank2 | awk '
  $1 == "C" { committed[$2 " " $3] = 1; next }
  $1 == "T" { key = $3 " " $4; for (i = 5; i <= NF; ++i) ids[key] = ids[key] " " $i }
  END {
    for (key in ids) if (key in committed) { n = split(ids[key], list, " "); for (i = 1; i <= n; ++i) ++seen[list[i]] }
    for (id in seen) { ++distinct; if (seen[id] != 1) ++twice }
    print distinct + 0, twice + 0
  }')
[ "$counts" = "$SAMPLES 0" ] || fail "samples trained (distinct, more than once): $counts, not $SAMPLES 0"
cmp -s "$WORK/weights.rank0.pt" "$WORK/weights.rank1.pt" || fail "the survivors' weights differ"
[ ! -e "$WORK/weights.rank2.pt" ] || fail "a third replica dumped weights"
echo "elastic: passed"
