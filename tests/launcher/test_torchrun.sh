#!/usr/bin/env bash
# Shoal ranks started by PyTorch 2.x's torchrun join its elastic agent's store
# (TORCHELASTIC_USE_AGENT_STORE) instead of serving one themselves: static rendezvous, the c10d
# rendezvous backend, and a restart (--max-restarts) after a rank failed in the first attempt.
# Built on LibTorch 1.13, whose own client cannot join a 2.x store, ranks join it with Shoal's client
# of c10d 2.x's protocol (src/comm/c10d_wire_store.h).
# Uses the torch 2.x of scripts/setup_torch_pypi.sh; exits 77 (skipped) when it is not installed.
#   test_torchrun.sh SOURCE_DIR WORKER
set -uo pipefail
SRC=$1
WORKER=$2
torch_dir=$(bash "$SRC/scripts/setup_torch_pypi.sh" --prefix)
if [ ! -f "$(dirname "$torch_dir")/.complete" ]; then
  echo "skipped: PyTorch 2.x not installed (scripts/setup_torch_pypi.sh)"
  exit 77
fi
export PYTHONPATH="$(dirname "$torch_dir")"
PY=python3
command -v python3 >/dev/null || PY=/usr/bin/python3
port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
failures=0
run() {  # run NAME EXPECTED_OKS TORCHRUN_ARGS...
  local name=$1 want=$2
  shift 2
  local log rc oks attempt
  log=$(mktemp)
  # PORT in the arguments is a free port picked now; another test may take it between the pick
  # and torchrun's bind (the machine runs tests in parallel), so a bind failure is tried again
  # once with a new port. Any other failure is final.
  for attempt in 1 2; do
    local p args=()
    p=$(port)
    for a in "$@"; do args+=("${a//PORT/$p}"); done
    # The port after MASTER_PORT is taken by a stranger for the run: the ranks must meet in the
    # agent's store itself, not on a store of their own beside it (the c10d rendezvous gives the
    # workers an ephemeral MASTER_PORT, whose next port any connection may hold).
    local holder=""
    if [ "${HOLD_NEXT_PORT:-0}" = 1 ]; then
      "$PY" -c 'import socket, sys, time
s = socket.socket(); s.bind(("127.0.0.1", int(sys.argv[1]))); s.listen(); time.sleep(300)' \
        $((p + 1)) 2>/dev/null &
      holder=$!
    fi
    timeout 120 "$PY" -m torch.distributed.run "${args[@]}" --no-python "$WORKER" >"$log" 2>&1
    rc=$?
    [ -n "$holder" ] && kill "$holder" 2>/dev/null
    grep -qiE "address already in use|EADDRINUSE" "$log" && [ $rc -ne 0 ] && [ $attempt = 1 ] || break
    echo "retry $name: port $p was taken before torchrun bound it"
  done
  oks=$(grep -c "sum ok" "$log")
  if [ $rc -ne 0 ] || [ "$oks" -ne "$want" ]; then
    echo "FAIL $name: torchrun exit $rc, $oks of $want ranks reported 'sum ok'; the ranks said:"
    grep -E "allreduce_worker|^rank " "$log"
    echo "the output's end:"
    tail -n 30 "$log"
    failures=$((failures + 1))
  else
    echo "ok   $name ($oks ranks)"
  fi
  rm -f "$log"
}
export OMP_NUM_THREADS=1
HOLD_NEXT_PORT=1 run static 2 --nnodes 1 --nproc-per-node 2 --master-addr 127.0.0.1 --master-port PORT
run c10d 2 --nnodes 1 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint "127.0.0.1:PORT"
# Rank 1 fails in attempt 0; the agent restarts both ranks, which meet again in attempt 1.
SHOAL_TEST_FAIL_ATTEMPT=0 run restart 2 --nnodes 1 --nproc-per-node 2 --max-restarts 1 \
  --master-addr 127.0.0.1 --master-port PORT
if [ $failures -ne 0 ]; then
  echo "$failures torchrun case(s) failed"
  exit 1
fi
echo "ORACLE OK test_torchrun: 3 passed, 0 failed"
