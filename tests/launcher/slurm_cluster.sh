# A real one-node SLURM cluster on loopback, for tests: sourced, not run.
#
#   . slurm_cluster.sh
#   slurm_cluster_start DIR      # munged, slurmctld, slurmd under DIR; exports SLURM_CONF
#   srun -n2 ...                 # the cluster's clients find it through SLURM_CONF
#   slurm_cluster_stop           # stops the daemons (call it from an EXIT trap)
#
# Everything lives in DIR: the munge key and socket, slurm.conf, state, spool, logs and pid files;
# the ports are free ones picked at start, so that clusters of concurrent tests do not meet. The
# node is this host under its own short name (NodeAddr 127.0.0.1), declared with
# SLURM_TEST_CPUS CPUs (default 4, config_overrides: more than the machine has is fine for jobs
# this small) so that a job step and the batch step fit side by side.
# slurm_cluster_start returns 77 when SLURM or munge is not installed (scripts/setup.sh installs
# them) and 1, with the daemons' logs, when the cluster does not come up within 60 s.
# slurm_munged_start and slurm_conf_write are its munged and slurm.conf, for clusters laid out
# otherwise (slurm_netns_test.sh: two nodes in two network namespaces).

slurm_cluster_missing() {
  local tool
  for tool in munged slurmctld slurmd srun sbatch scontrol sinfo; do
    command -v "$tool" >/dev/null 2>&1 || [ -x "/usr/sbin/$tool" ] || { echo "$tool"; return 0; }
  done
  return 1
}

# A TCP port free on loopback a moment ago.
slurm_free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# slurm_wait SECONDS COMMAND...: runs COMMAND every 0.2 s until it succeeds; 1 after SECONDS.
slurm_wait() {
  local limit=$1
  shift
  local deadline=$(( $(date +%s) + limit ))
  until "$@" >/dev/null 2>&1; do
    [ "$(date +%s)" -ge "$deadline" ] && return 1
    sleep 0.2
  done
}

slurm_cluster_logs() {
  local log
  for log in "$SLURM_CLUSTER_DIR"/munged.log "$SLURM_CLUSTER_DIR"/slurmctld.log \
             "$SLURM_CLUSTER_DIR"/slurmd.log; do
    [ -f "$log" ] && { echo "--- $log"; tail -n 25 "$log"; }
  done
}

# slurm_munged_start DIR: munged with a fresh key, its socket DIR/munge/munge.sock (the one
# slurm_conf_write names), pid file DIR/munge/munged.pid, log DIR/munged.log.
slurm_munged_start() {
  local dir=$1
  mkdir -p "$dir/munge"
  chmod 711 "$dir/munge"  # clients reach the socket; nobody lists the key
  # munged wants its key readable by its user only, and a socket directory nobody else may write.
  head -c 1024 /dev/urandom >"$dir/munge/munge.key"
  chmod 400 "$dir/munge/munge.key"
  munged --force --key-file="$dir/munge/munge.key" --socket="$dir/munge/munge.sock" \
    --pid-file="$dir/munge/munged.pid" --log-file="$dir/munged.log" \
    --seed-file="$dir/munge/munged.seed"
}

# slurm_conf_write DIR CLUSTER CTLD_HOST CTLD_PORT SLURMD_PORT SLURMD_SUFFIX LINE...: writes
# DIR/slurm.conf for a test cluster run by this user: munge auth through DIR/munge/munge.sock,
# state, spool, pid and log files under DIR (the slurmd's as slurmd$SLURMD_SUFFIX.pid/.log, "-%n"
# for one per node), then the LINEs (nodes, partition, other settings), one a line.
#   CTLD_HOST is SlurmctldHost's value, e.g. "snode0(10.78.0.1)".
slurm_conf_write() {
  local dir=$1 cluster=$2 ctld_host=$3 ctld_port=$4 slurmd_port=$5 suffix=$6 user
  shift 6
  user=$(id -un)
  cat >"$dir/slurm.conf" <<EOF
ClusterName=$cluster
SlurmctldHost=$ctld_host
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=$user
SlurmdUser=$user
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.sock
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd$suffix.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd$suffix.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
ReturnToService=2
MessageTimeout=30
InactiveLimit=0
KillWait=5
EOF
  printf '%s\n' "$@" >>"$dir/slurm.conf"
}

# slurm_reaper_start DIR [NETNS...]: if this test's shell is killed (CTest's time-out sends
# SIGKILL, which runs no EXIT trap), the daemons it started would outlive it, holding their ports
# and the next run's namespaces. A watcher in its own session waits for the shell to go, then
# kills every daemon whose pid file is under DIR, deletes the network namespaces named and DIR.
# After a normal exit the trap has removed DIR and the namespaces, and the watcher finds nothing.
slurm_reaper_start() {
  local dir=$1
  shift
  setsid bash -c '
    owner=$1 dir=$2
    shift 2
    while kill -0 "$owner" 2>/dev/null; do sleep 1; done
    for f in "$dir"/*.pid "$dir"/munge/*.pid; do
      [ -f "$f" ] && kill -9 "$(cat "$f")" 2>/dev/null
    done
    for ns in "$@"; do ip netns delete "$ns" 2>/dev/null; done
    rm -rf "$dir"' slurm-reaper "$$" "$dir" "$@" </dev/null >/dev/null 2>&1 &
}

slurm_cluster_start() {
  local dir=$1 missing
  if missing=$(slurm_cluster_missing); then
    echo "slurm: $missing is not installed (scripts/setup.sh installs slurm-wlm and munge)"
    return 77
  fi
  export PATH="$PATH:/usr/sbin"
  SLURM_CLUSTER_DIR=$dir
  mkdir -p "$dir/state" "$dir/spool"
  slurm_reaper_start "$dir"
  slurm_munged_start "$dir" >"$dir/munged.out" 2>&1 ||
    { echo "slurm: munged did not start"; cat "$dir/munged.out"; slurm_cluster_logs; return 1; }

  local host ctld_port slurmd_port cpus=${SLURM_TEST_CPUS:-4}
  host=$(hostname -s)
  ctld_port=$(slurm_free_port)
  slurmd_port=$(slurm_free_port)
  slurm_conf_write "$dir" shoaltest "$host(127.0.0.1)" "$ctld_port" "$slurmd_port" "" \
    "MinJobAge=300" \
    "NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN" \
    "PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP"
  export SLURM_CONF=$dir/slurm.conf
  slurmctld -c -f "$SLURM_CONF" >"$dir/slurmctld.out" 2>&1 ||
    { echo "slurm: slurmctld did not start"; cat "$dir/slurmctld.out"; slurm_cluster_logs; return 1; }
  slurmd -f "$SLURM_CONF" >"$dir/slurmd.out" 2>&1 ||
    { echo "slurm: slurmd did not start"; cat "$dir/slurmd.out"; slurm_cluster_logs; return 1; }
  # Up when the node is idle (not down or drained) for the controller.
  if ! slurm_wait 60 sh -c "sinfo -h -N -o %t | grep -qx idle"; then
    echo "slurm: the node did not become idle within 60 s: $(sinfo -h -N -o '%t %E' 2>&1)"
    slurm_cluster_logs
    return 1
  fi
}

slurm_cluster_stop() {
  [ -n "${SLURM_CLUSTER_DIR:-}" ] || return 0
  local dir=$SLURM_CLUSTER_DIR pidfile pid
  scancel --full --quiet -u "$(id -un)" >/dev/null 2>&1 || true
  for pidfile in "$dir/slurmd.pid" "$dir/slurmctld.pid" "$dir/munge/munged.pid"; do
    [ -f "$pidfile" ] || continue
    pid=$(cat "$pidfile")
    kill "$pid" 2>/dev/null || continue
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
    rm -f "$pidfile"  # the reaper must not find a pid the system may give to another process
  done
  SLURM_CLUSTER_DIR=
}
