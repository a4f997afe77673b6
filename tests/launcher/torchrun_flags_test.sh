#!/usr/bin/env bash
# `shoal run` with torchrun's command line: for each flag set, the workers' environment is what
# torchrun gives (the variables a program reads: RANK ... TORCHELASTIC_RUN_ID, OMP_NUM_THREADS), the
# refusals name the flag, and --log-dir/--redirects/--tee write torchrun's log layout. Where
# Debian's torchrun (python3-torch) runs, the same flags are given to it and the environments
# compared variable by variable; the expected values are also written out here, so the test means
# the same without it.
#   torchrun_flags_test.sh SHOAL_BINARY
set -uo pipefail
SHOAL=${1:?usage: torchrun_flags_test.sh SHOAL_BINARY}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT OMP_NUM_THREADS \
  OMPI_COMM_WORLD_RANK PMI_RANK SLURM_PROCID SLURM_STEP_ID SLURM_STEPID SLURM_JOB_ID
KEYS="RANK LOCAL_RANK WORLD_SIZE LOCAL_WORLD_SIZE GROUP_RANK GROUP_WORLD_SIZE ROLE_RANK
      ROLE_WORLD_SIZE MASTER_ADDR MASTER_PORT TORCHELASTIC_RESTART_COUNT TORCHELASTIC_MAX_RESTARTS
      TORCHELASTIC_RUN_ID OMP_NUM_THREADS"
# Debian's torchrun 1.13 under Python 3.11 cannot parse --redirects/--tee 0 or 3 (IntFlag
# iteration changed); 1 works, and is given to both.
TORCHRUN=""
if /usr/bin/python3 -c 'import torch.distributed.run' 2>/dev/null; then
  TORCHRUN="/usr/bin/python3 -m torch.distributed.run"
fi
failures=0
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
DUMP='for k in '"$(echo $KEYS)"'; do eval "echo $k=\${$k-<unset>}"; done > "$OUT/env.$LOCAL_RANK"; echo "out $RANK"; echo "err $RANK" >&2'

# launch NAME LAUNCHER FLAGS...: runs the dump worker; its environments land in $WORK/NAME/env.N.
launch() {
  local name=$1 launcher=$2
  shift 2
  mkdir -p "$WORK/$name"
  OUT="$WORK/$name" timeout 60 $launcher "$@" sh -c "$DUMP" >"$WORK/$name.out" 2>"$WORK/$name.err"
}
# value NAME LOCAL_RANK KEY
value() { grep "^$3=" "$WORK/$1/env.$2" 2>/dev/null | cut -d= -f2-; }
# expect NAME LOCAL_RANK KEY=VALUE...
expect() {
  local name=$1 lr=$2
  shift 2
  local pair got
  for pair in "$@"; do
    got=$(value "$name" "$lr" "${pair%%=*}")
    if [ "$got" != "${pair#*=}" ]; then
      echo "FAIL $name: local rank $lr has ${pair%%=*}=$got, torchrun gives ${pair#*=}"
      failures=$((failures + 1))
    fi
  done
}
# same_as_torchrun NAME NPROC IGNORED_KEYS FLAGS...: the same flags under Debian's torchrun.
same_as_torchrun() {
  local name=$1 nproc=$2 ignored=$3
  shift 3
  [ -n "$TORCHRUN" ] || return 0
  launch "$name.torchrun" "$TORCHRUN" --redirects 1 --tee 1 "$@" --no_python
  [ -f "$WORK/$name.torchrun/env.0" ] || {
    echo "FAIL $name: torchrun did not run the worker:"; tail -n 5 "$WORK/$name.torchrun.err"
    failures=$((failures + 1)); return 0; }
  local lr key
  for lr in $(seq 0 $((nproc - 1))); do
    for key in $KEYS; do
      case " $ignored " in *" $key "*) continue ;; esac
      if [ "$(value "$name" "$lr" "$key")" != "$(value "$name.torchrun" "$lr" "$key")" ]; then
        echo "FAIL $name: local rank $lr: $key=$(value "$name" "$lr" "$key") under shoal run," \
             "$(value "$name.torchrun" "$lr" "$key") under torchrun"
        failures=$((failures + 1))
      fi
    done
  done
}
mark=0
ok() {  # ok TEXT: printed when the case added no failure
  [ $failures -eq $mark ] && echo "ok   $*"
  mark=$failures
}

# --standalone: one node, localhost, a free port, a random run id.
launch standalone "$SHOAL run" --standalone --nproc-per-node 2 --redirects 1 --tee 1
expect standalone 1 RANK=1 LOCAL_RANK=1 WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 GROUP_RANK=0 \
  GROUP_WORLD_SIZE=1 ROLE_RANK=1 ROLE_WORLD_SIZE=2 MASTER_ADDR=localhost OMP_NUM_THREADS=1
[ "$(value standalone 0 TORCHELASTIC_RUN_ID)" != none ] && [ "$(value standalone 0 MASTER_PORT)" -gt 0 ] ||
  { echo "FAIL standalone: no run id or port"; failures=$((failures + 1)); }
same_as_torchrun standalone 2 "MASTER_PORT TORCHELASTIC_RUN_ID" --standalone --nproc_per_node 2
ok "--standalone"

# Static rendezvous with underscore spellings, --rdzv_id, --max_restarts, --monitor_interval.
port=$(free_port)
launch static "$SHOAL run" --nnodes 1:1 --nproc_per_node 3 --master_addr 127.0.0.1 \
  --master_port "$port" --rdzv_id job42 --max_restarts 2 --monitor_interval 1 --start_method fork
expect static 2 RANK=2 WORLD_SIZE=3 LOCAL_WORLD_SIZE=3 MASTER_ADDR=127.0.0.1 MASTER_PORT="$port" \
  TORCHELASTIC_RUN_ID=job42 TORCHELASTIC_MAX_RESTARTS=2 TORCHELASTIC_RESTART_COUNT=0
same_as_torchrun static 3 "" --nnodes 1:1 --nproc_per_node 3 --master_addr 127.0.0.1 \
  --master_port "$port" --rdzv_id job42 --max_restarts 2 --monitor_interval 1 --start_method fork
ok "--nnodes 1:1 --nproc_per_node 3 --master_addr/--master_port --rdzv_id --max_restarts --monitor_interval"

# c10d with an endpoint: rank 0 serves the rendezvous there (torchrun's agent serves it there and
# gives the workers a port of its own: MASTER_* are not compared with torchrun's).
port=$(free_port)
launch c10d "$SHOAL run" --nnodes 1 --nproc-per-node 2 --rdzv-backend c10d \
  --rdzv-endpoint "127.0.0.1:$port" --rdzv-id j7
expect c10d 0 RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT="$port" TORCHELASTIC_RUN_ID=j7
same_as_torchrun c10d 2 "MASTER_ADDR MASTER_PORT" --nnodes 1 --nproc_per_node 2 \
  --rdzv_backend c10d --rdzv_endpoint "127.0.0.1:$port" --rdzv_id j7
ok "--rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id"

# Node 1 of 2 (static): ranks after node 0's; not started further than its environment.
port=$(free_port)
# (a job on several nodes needs one token on all of them)
SHOAL_AUTH_TOKEN=0123456789abcdef launch node1 "$SHOAL run" --nnodes 2 --node-rank 1 --nproc-per-node 2 --master-addr 10.9.9.9 \
  --master-port "$port"
expect node1 1 RANK=3 LOCAL_RANK=1 WORLD_SIZE=4 GROUP_RANK=1 GROUP_WORLD_SIZE=2 ROLE_RANK=3 \
  ROLE_WORLD_SIZE=4 MASTER_ADDR=10.9.9.9
ok "--nnodes 2 --node-rank 1"

# --nproc-per-node cpu / auto: the cores of the affinity mask (no GPU here).
cores=$(python3 -c 'import os; print(len(os.sched_getaffinity(0)))')
launch cpu "$SHOAL run" --nproc-per-node cpu
launch auto "$SHOAL run" --nproc_per_node auto
expect cpu 0 WORLD_SIZE="$cores"
if python3 -c 'import sys; sys.exit(0)' && ! nvidia-smi -L >/dev/null 2>&1; then
  expect auto 0 WORLD_SIZE="$cores"
fi
ok "--nproc-per-node cpu and auto ($cores)"

# --log-dir with --redirects 3 (files only) for local rank 0 and --tee 1 (file and console) for 1.
launch logs "$SHOAL run" --nproc-per-node 2 --log-dir "$WORK/logs" --rdzv-id logjob -r 0:3 -t 1:1
dir=$(ls -d "$WORK"/logs/logjob_* 2>/dev/null | head -n 1)
if [ -z "$dir" ] || [ "$(cat "$dir/attempt_0/0/stdout.log")" != "out 0" ] ||
   [ "$(cat "$dir/attempt_0/0/stderr.log")" != "err 0" ] ||
   [ "$(cat "$dir/attempt_0/1/stdout.log")" != "out 1" ] || [ -e "$dir/attempt_0/1/stderr.log" ] ||
   grep -q "out 0\|err 0" "$WORK/logs.out" "$WORK/logs.err" ||
   ! grep -q "out 1" "$WORK/logs.out" || ! grep -q "err 1" "$WORK/logs.err"; then
  echo "FAIL --log-dir/--redirects/--tee: layout or console wrong"; find "$WORK/logs"
  cat "$WORK/logs.out" "$WORK/logs.err"
  failures=$((failures + 1))
  mark=$failures
else
  ok "--log-dir --redirects 0:3 --tee 1:1 (LOG_DIR/RUN_ID_XXXXXX/attempt_0/LOCAL_RANK/*.log)"
fi

# Refusals: one line each, naming the flag.
refused() {  # refused FLAG_NAME ARGS...
  local flag=$1
  shift
  local err
  err=$(timeout 30 "$SHOAL" run "$@" true 2>&1 >/dev/null)
  if [ $? -eq 0 ] || [ "$(echo "$err" | wc -l)" -ne 1 ] || ! echo "$err" | grep -q -- "$flag"; then
    echo "FAIL shoal run $*: not refused in one line naming $flag: $err"
    failures=$((failures + 1))
  else
    echo "ok   refused: shoal run $* ($err)"
  fi
  mark=$failures
}
refused "--nnodes" --nnodes 1:2 --nproc-per-node 1
# An elastic range is fault-tolerant training's (test_netns_elastic runs one).
refused "--fault-tolerant" --nnodes 1:2 --nproc-per-node 1
refused "MIN must not exceed MAX" --nnodes 3:2 --fault-tolerant
refused "--rdzv-conf" --rdzv-conf read_timeout=5
refused "--rdzv-conf 'join_timeout=1e300': at most" --rdzv-conf join_timeout=1e300 --nproc-per-node 1
refused "--nproc-per-node" --nproc-per-node many
refused "--rdzv-backend" --rdzv-backend etcd --nproc-per-node 1
refused "--node-rank" --nnodes 2 --rdzv-backend c10d --rdzv-endpoint 10.0.0.1:29400
refused "--rdzv-endpoint ':29400' has no host" --rdzv-endpoint :29400 --nproc-per-node 1
refused "--master-addr '' has no host" --master-addr "" --nproc-per-node 1
refused "--module" -m --nproc-per-node 1
refused "--redirects" --redirects 4 --nproc-per-node 1
[ -n "$TORCHRUN" ] && echo "(compared with $($TORCHRUN --help >/dev/null 2>&1 && /usr/bin/python3 -c 'import torch; print("torchrun", torch.__version__)'))"
[ $failures -eq 0 ] || { echo "$failures failure(s)"; exit 1; }
echo "all passed"
