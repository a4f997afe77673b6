// The launcher: starts the processes of a distributed job on this node (torchrun's counterpart).
//
// `shoal run` is a thin command line over launch(); programs that want to re-launch themselves as
// N ranks (`shoal train --nproc-per-node N`, `shoal bench allreduce`) call launch() directly.
//
// Each worker is started with fork+exec in a process group of its own and receives the torchrun
// environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE,
// ROLE_NAME, ROLE_RANK, ROLE_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so init_process_group()'s env://
// rendezvous finds the others. SIGINT/SIGTERM sent to the launcher are forwarded to every worker.
// When a worker fails, the others get SIGTERM and, after the grace period, SIGKILL; launch()
// returns the failing worker's exit status (128 + signal number for a signal).
//
// The job is described as a list of roles: "worker" first, then optionally a parameter server's
// "server" role (`shoal run --num-servers S`). RANK counts every process of the job (workers
// first), ROLE_RANK / ROLE_WORLD_SIZE count within the role. One attempt runs the whole set, so
// that a restart loop around it (`--max-restarts`) can be added without changing the interface.
//
// Thread safety: launch() installs SIGINT/SIGTERM/SIGCHLD handlers for its duration and restores
// the previous ones afterwards; only one launch() may run in a process at a time (a second one
// throws InvalidArgument).
#pragma once

#include <chrono>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace shoal::launcher {

/// One kind of process of the job and how many of it run on each node.
struct RoleSpec {
  /// "worker" (the first role) or "server".
  std::string name = "worker";
  /// Processes of this role on each node.
  int nproc_per_node = 1;
  /// The program and its arguments; the program is looked up on PATH when it has no '/'.
  std::vector<std::string> command;
  /// Extra environment variables for this role's processes (applied after the torchrun ones).
  std::vector<std::pair<std::string, std::string>> env;
};

/// torchrun's --redirects / --tee value: which of a worker's streams go to its log file, as bits
/// (1 stdout, 2 stderr, 3 both), for every local rank ("3") or per local rank ("0:3,1:1").
struct StreamLogs {
  int all = 0;
  std::map<int, int> per_local_rank;
  /// The bits for one local rank.
  int of(int local_rank) const;
  bool any() const { return all != 0 || !per_local_rank.empty(); }
  /// Parses torchrun's syntax; throws InvalidArgument naming `flag` for anything else.
  static StreamLogs parse(const std::string& text, const std::string& flag);
};

struct LaunchOptions {
  /// Number of nodes of the job, and this node's index among them (torchrun's GROUP_RANK).
  int nnodes = 1;
  int node_rank = 0;
  /// Where rank 0 listens for the rendezvous. A loopback address is refused when nnodes > 1.
  std::string master_addr = "127.0.0.1";
  /// 0 picks a free port (single-node jobs only: other nodes could not know it).
  int master_port = 29500;
  /// What to start: "worker", then optionally "server".
  std::vector<RoleSpec> roles;
  /// Prefix every output line of a worker with "[rank N] " (stdout and stderr kept apart).
  bool prefix_output = true;
  /// After a worker failed (or a signal was forwarded), how long the others get to exit after
  /// SIGTERM before they are killed.
  std::chrono::milliseconds grace_period{5000};
  /// Names the launcher in its own messages on stderr ("shoal run: rank 2 ... exited ...").
  std::string log_name = "shoal run";
  /// When a worker fails, stop the others and start all of them again, up to this many times
  /// (torchrun's --max-restarts). Workers see TORCHELASTIC_RESTART_COUNT (0, 1, ...) and should
  /// resume from their last checkpoint (`shoal train` does). Interruptions are never restarted.
  int max_restarts = 0;
  /// Print the launcher's notes (OMP_NUM_THREADS); the failure summary is printed regardless.
  bool verbose = true;
  /// A worker that fails does not stop the job while another worker runs: parameter-server
  /// training under asp/ssp goes on without it (`shoal train --strategy ps` sets this unless
  /// --consistency bsp). A server's failure still stops everything. The exit status is 0 when
  /// every other process succeeds; the failures are reported.
  bool tolerate_worker_failures = false;
  /// Fault-tolerant training (`shoal train --fault-tolerant`): node 0's launcher serves the job's
  /// store at master_addr:master_port (workers are told SHOAL_FT_AGENT_STORE=1), so that any
  /// worker may die, rank 0 included; a failed worker does not stop the others
  /// (tolerate_worker_failures). The job fails when the launcher of node 0 dies.
  bool fault_tolerant = false;
  /// Elastic membership, torchrun's `--nnodes MIN:MAX` (fault_tolerant only): the job starts once
  /// min_nnodes node agents met at node 0's store (waiting up to rdzv_last_call for more, up to
  /// nnodes); an agent started later joins the running job, its workers entering at a step
  /// boundary from a live peer (launcher/elastic_rendezvous.h). 0: membership is fixed (nnodes).
  int min_nnodes = 0;
  std::chrono::milliseconds rdzv_join_timeout{600'000};
  std::chrono::milliseconds rdzv_last_call{30'000};
  /// torchrun's --rdzv-id: the job's name, given to the workers as TORCHELASTIC_RUN_ID.
  std::string run_id = "none";
  /// torchrun's --log-dir, --redirects and --tee: a worker's redirected streams go to
  /// LOG_DIR/RUN_ID_XXXXXX/attempt_N/LOCAL_RANK/{stdout,stderr}.log only, its teed ones to that file
  /// and to the console. Without a log_dir, a fresh directory under $TMPDIR (named on stderr).
  std::string log_dir;
  StreamLogs redirects;
  StreamLogs tee;

  /// The common case: `nproc_per_node` workers running `command` on one node.
  static LaunchOptions workers(int nproc_per_node, std::vector<std::string> command);
  /// A parameter-server job: `workers` worker and `servers` server processes per node running
  /// `command`, both roles told SHOAL_PS_NUM_WORKERS and SHOAL_PS_NUM_SERVERS (job totals).
  static LaunchOptions parameter_server(int workers, int servers, std::vector<std::string> command,
                                        int nnodes = 1);
};

/// Starts the job's processes on this node, waits for them and returns the job's exit status:
/// 0 when every worker exited 0, else the first failing worker's status (128 + signal number when
/// it was killed by a signal), or 128 + signal number when the launcher itself was interrupted.
/// Throws InvalidArgument for options that cannot work (with what to do instead) and Error when a
/// worker cannot be started (the workers already started are stopped first).
int launch(const LaunchOptions& options);

/// How many times this job's workers were restarted (TORCHELASTIC_RESTART_COUNT, which launch()
/// and torchrun set; 0 when unset). Throws InvalidArgument naming the variable when it is set to
/// anything but a count.
int restart_count();

/// This program's own path (/proc/self/exe), for programs that re-launch themselves as N ranks:
/// launch(LaunchOptions::workers(n, {self_executable(), args...})).
std::string self_executable();

/// This program's main, for workers that are this program itself (self_executable(), or the same
/// file by another path): once set, launch() starts such a worker with fork() alone, no exec,
/// when the launcher has a single thread (the worker then runs `entry(argc, argv)` with the
/// worker's arguments and environment and exits with its result). The worker skips loading the
/// program and its libraries again: LibTorch alone takes 0.6 s. Everything else is as after exec:
/// its own process group, /dev/null for stdin, default signal dispositions, no inherited file
/// descriptor beyond 0-2, the intra-op and BLAS thread counts of its OMP_NUM_THREADS.
/// SHOAL_LAUNCH_EXEC=1 in the launcher's environment starts every worker with exec instead.
using SelfEntry = int (*)(int argc, char** argv);
void set_self_entry(SelfEntry entry);

/// Cores this process may run on: its CPU affinity mask (taskset, a container, or a launcher's
/// binding — mpirun --bind-to core, srun --cpu-bind=cores — limits it); at least 1.
int available_cores();

/// A TCP port that was free on every interface a moment ago (bound to port 0 and released).
int pick_free_port();

/// True for "localhost", 127.0.0.0/8, ::1, and names that resolve only to loopback addresses.
bool is_loopback_address(const std::string& host);

}  // namespace shoal::launcher
