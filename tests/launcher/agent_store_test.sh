#!/usr/bin/env bash
# Shoal ranks under a torchrun agent of either PyTorch generation meet in the agent's own store:
# PyTorch's TCPStore serves it here (Debian's 1.13 for a 1.x agent, the PyPI 2.x for a 2.x agent)
# and two ranks get the environment that generation's torchrun gives its workers. The check is in
# the store itself: the ranks' keys arrive there. While they run, a stranger holds the port after
# MASTER_PORT, where ranks that could not join would serve a store of their own. The one pair no
# client here speaks, LibTorch 2.x under a 1.x agent, must meet on that store of its own instead.
#   agent_store_test.sh SOURCE_DIR WORKER LIBTORCH_VERSION
set -uo pipefail
SRC=$1
WORKER=$2
LIBTORCH_MAJOR=${3%%.*}
torch_dir=$(bash "$SRC/scripts/setup_torch_pypi.sh" --prefix)
PY2=""
if [ -f "$(dirname "$torch_dir")/.complete" ]; then
  PY2="env PYTHONPATH=$(dirname "$torch_dir") python3"
fi
PY1=""
/usr/bin/python3 -c 'import torch' 2>/dev/null && PY1=/usr/bin/python3
if [ -z "$PY1" ] && [ -z "$PY2" ]; then
  echo "skipped: neither Debian's python3-torch nor PyTorch 2.x (scripts/setup_torch_pypi.sh)"
  exit 77
fi
work=$(mktemp -d)
# Also on an early exit: no stand-in agent or port holder is left behind.
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1
unset TORCH_NCCL_ASYNC_ERROR_HANDLING NCCL_ASYNC_ERROR_HANDLING TORCHELASTIC_USE_AGENT_STORE
# The agent's store: writes its port, then waits for the ranks' "done" file (at most 150 s) and
# prints how many keys they left in it.
cat >"$work/agent.py" <<'EOF'
import datetime, os, sys, time
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=60),
                      wait_for_workers=False)
before = store.num_keys()
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(str(store.port))
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
deadline = time.time() + 150
while not os.path.exists(sys.argv[2]) and time.time() < deadline:
    time.sleep(0.05)
print("keys the ranks wrote:", store.num_keys() - before, flush=True)
EOF
failures=0
passed=0
# case NAME PYTHON GENERATION(1|2) EXPECT(agent|own)
case_run() {
  local name=$1 py=$2 gen=$3 expect=$4 dir="$work/$1"
  mkdir -p "$dir"
  $py "$work/agent.py" "$dir/port" "$dir/done" >"$dir/agent.log" 2>&1 &
  local agent=$!
  local waited=0
  while [ ! -f "$dir/port" ] && [ $waited -lt 600 ] && kill -0 $agent 2>/dev/null; do
    sleep 0.1
    waited=$((waited + 1))
  done
  if [ ! -f "$dir/port" ]; then
    echo "FAIL $name: the stand-in agent store did not start:"
    cat "$dir/agent.log"
    kill $agent 2>/dev/null
    failures=$((failures + 1))
    return
  fi
  local port
  port=$(cat "$dir/port")
  local holder=""
  if [ "$expect" = agent ]; then
    /usr/bin/python3 -c 'import socket, sys, time
s = socket.socket(); s.bind(("127.0.0.1", int(sys.argv[1]))); s.listen(); time.sleep(300)' \
      $((port + 1)) 2>/dev/null &
    holder=$!
  fi
  local extra=()
  [ "$gen" = 2 ] && extra=(TORCH_NCCL_ASYNC_ERROR_HANDLING=1)
  [ "$gen" = 1 ] && extra=(NCCL_ASYNC_ERROR_HANDLING=1)
  local pids=()
  for r in 0 1; do
    env RANK=$r LOCAL_RANK=$r GROUP_RANK=0 ROLE_RANK=$r WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 \
      GROUP_WORLD_SIZE=1 ROLE_WORLD_SIZE=2 ROLE_NAME=default MASTER_ADDR=127.0.0.1 \
      MASTER_PORT="$port" TORCHELASTIC_RESTART_COUNT=0 TORCHELASTIC_MAX_RESTARTS=0 \
      TORCHELASTIC_RUN_ID=agent-store-test TORCHELASTIC_USE_AGENT_STORE=True "${extra[@]}" \
      timeout 120 "$WORKER" >"$dir/rank$r.log" 2>&1 &
    pids+=($!)
  done
  local rc=0
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  touch "$dir/done"
  wait $agent
  [ -n "$holder" ] && kill "$holder" 2>/dev/null
  local keys oks
  keys=$(sed -n 's/^keys the ranks wrote: //p' "$dir/agent.log")
  oks=$(cat "$dir"/rank*.log | grep -c "sum ok")
  local why=""
  [ $rc -ne 0 ] || [ "$oks" -ne 2 ] && why="$oks of 2 ranks reported 'sum ok'"
  if [ -z "$why" ] && [ "$expect" = agent ] && ! [ "${keys:-0}" -gt 0 ]; then
    why="the ranks left no key in the agent's store (keys: '${keys}')"
  fi
  if [ -z "$why" ] && [ "$expect" = own ] && [ "${keys:-x}" != 0 ]; then
    why="the ranks wrote into a store whose protocol they do not speak (keys: '${keys}')"
  fi
  if [ -n "$why" ] && [ "$expect" = own ] && [ "${RETRIED:-0}" = 0 ] &&
     grep -q "the port is in use" "$dir"/rank*.log; then
    # The store of their own listens on the port after the agent's, which the kernel chose
    # (ephemeral, as torchrun's c10d rendezvous does): another connection may hold it. Once more.
    echo "retry $name: port $((port + 1)) was taken"
    rm -rf "$dir"
    RETRIED=1 case_run "$@"
    return
  fi
  if [ -n "$why" ]; then
    echo "FAIL $name: $why; the ranks and the store said:"
    cat "$dir"/rank*.log "$dir/agent.log"
    failures=$((failures + 1))
  else
    echo "ok   $name (the ranks met $([ "$expect" = agent ] && echo "in the agent's store, $keys keys" || echo "on a store of their own"))"
    passed=$((passed + 1))
  fi
}
if [ -n "$PY2" ]; then
  case_run agent-2x "$PY2" 2 agent
fi
if [ -n "$PY1" ]; then
  if [ "$LIBTORCH_MAJOR" -ge 2 ]; then
    case_run agent-1x "$PY1" 1 own
  else
    case_run agent-1x "$PY1" 1 agent
  fi
fi
if [ $failures -ne 0 ]; then
  echo "$failures agent store case(s) failed"
  exit 1
fi
echo "ORACLE OK agent_store_test: $passed passed, 0 failed"
