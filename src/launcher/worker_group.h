// WorkerGroup: one attempt at running the job's workers on this node — start them all, copy their
// output, forward signals, and stop them all when one fails.
//
// One WorkerGroup is one attempt; a restart loop (`--max-restarts`) creates a fresh group per
// attempt around it, and roles are just more WorkerSpecs in the list.
//
// Thread safety: not thread-safe; run() is called once, from one thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "launcher/exit_status.h"
#include "launcher/line_prefixer.h"
#include "launcher/worker_process.h"
#include "launcher/worker_spec.h"

namespace shoal::launcher {

class SignalRelay;

struct WorkerGroupOptions {
  bool prefix_output = true;
  /// Between SIGTERM and SIGKILL when the group is being stopped.
  std::chrono::milliseconds grace_period{5000};
  /// A failed process of the "worker" role does not stop the group while another worker runs
  /// (parameter-server training under asp/ssp goes on without it); servers' failures still do.
  bool tolerate_worker_failures = false;
  /// How many failed workers the group starts again on their own while the others go on (fault
  /// tolerance with --max-restarts: the replacement joins the running job); with
  /// tolerate_worker_failures only.
  int replace_failed_workers = 0;
  /// The workers are fault-tolerant replicas (FaultTolerantManager), which finish together: one
  /// that fails after every other worker succeeded was not among them at the end (left out after
  /// a stop, or a replacement too late to join), and the group is as successful as they made it.
  /// With tolerate_worker_failures only.
  bool replicas_finish_together = false;
  /// Called with a worker's rank once it has exited (fault tolerance marks it dead in the store).
  std::function<void(int rank)> on_exit;
  /// Names the launcher in what the group prints ("shoal run: ...").
  std::string log_name = "shoal run";
};

/// How an attempt ended.
struct GroupResult {
  enum class Outcome {
    kSucceeded,     ///< every worker exited 0
    kWorkerFailed,  ///< a worker failed; the others were stopped
    kInterrupted,   ///< the launcher received SIGINT/SIGTERM and forwarded it
  };
  Outcome outcome = Outcome::kSucceeded;
  /// The launcher's exit status for this outcome (0, the worker's status, 128 + signal).
  int exit_code = 0;
  /// kWorkerFailed: the first worker seen failing (exiting with an error).
  std::string failed_label;
  pid_t failed_pid = -1;
  ExitStatus failed_status;
  /// kWorkerFailed, when another worker's error file (log/error_file.h) says that it failed
  /// before that exit (its failure made the others fail, and they were done exiting first): that
  /// worker's label, pid and error message; empty label otherwise.
  std::string first_failed_label;
  pid_t first_failed_pid = -1;
  std::string first_failed_error;
  /// kInterrupted: the signal received.
  int interrupt_signal = 0;
  /// Workers still running when the failure or the signal came (those the launcher stopped).
  int stopped = 0;
  /// Of those, how many had to be killed after the grace period (or a second signal).
  int killed = 0;
  /// A second SIGINT/SIGTERM cut the grace period short.
  bool second_signal = false;
  /// Workers that could not be reaped even after SIGKILL (uninterruptible); normally 0.
  int unreaped = 0;
  /// Failures the group went on without (tolerate_worker_failures): "rank 1 (pid 42) was
  /// killed by SIGKILL".
  std::vector<std::string> tolerated;
  /// Failures whose worker was started again on its own (replace_failed_workers), as tolerated.
  std::vector<std::string> replaced;
};

class WorkerGroup {
 public:
  /// Why 5 s: SIGKILL ends a process at once unless it is stuck in the kernel; past this the
  /// launcher reports the worker instead of waiting forever.
  static constexpr std::chrono::milliseconds kReapTimeout{5000};
  /// Why 200 ms: SIGCHLD wakes the loop at once; this only bounds a lost wake-up.
  static constexpr std::chrono::milliseconds kPollInterval{200};

  WorkerGroup(std::vector<WorkerSpec> specs, WorkerGroupOptions options);
  ~WorkerGroup();

  /// Starts every worker, supervises them until all have ended, and says how it went.
  /// Throws Error when a worker cannot be started (those already started are stopped first).
  GroupResult run(SignalRelay& relay);

  /// The process ids of the workers started, also after they ended (for cleaning up after them).
  std::vector<int> pids() const;

 private:
  int count_running() const;
  void signal_all(int signal);
  void begin_stop(int signal, std::chrono::steady_clock::time_point now);
  void read_output(int max_rounds);
  void reap(GroupResult& result, std::chrono::steady_clock::time_point now);
  /// Processes of the "worker" role still running.
  int running_workers() const;
  /// Names in `result` the worker whose error file has the earliest stamp, where that is not the
  /// worker first seen exiting (first_failed_*).
  void name_first_failure(GroupResult& result) const;
  /// Shows the error line held back by the worker whose error file's stamp `result` names as the
  /// first to fail, else the first held.
  void show_first_error_line(const GroupResult& result);
  void stop_now();
  /// Under tolerate_worker_failures: whether the group goes on after worker `index` failed
  /// (noted in `result`; the worker is started again while replacements are left).
  bool go_on_without(size_t index, GroupResult& result);
  /// Whether every worker but `index` has exited successfully.
  bool others_succeeded(size_t index) const;
  /// Starts the worker at `index` again in its place (replace_failed_workers).
  void replace(size_t index);

  std::vector<WorkerSpec> specs_;
  WorkerGroupOptions options_;
  std::vector<std::unique_ptr<WorkerProcess>> workers_;
  std::vector<int> pids_;  // every worker started, kept after they are reaped
  std::set<size_t> replacements_;  // indices of workers started again (replace())
  std::vector<int> log_fds_;  // --log-dir files, closed with the group
  SharedErrorLines error_lines_;  // the workers' stderr copies show one error line (see there)
  std::vector<std::unique_ptr<LinePrefixer>> prefixers_;  // stdout, stderr per worker
  bool stopping_ = false;
  int64_t first_exit_seen_us_ = 0;  // when the first failed worker's exit was seen (epoch us)
  bool killed_ = false;
  std::chrono::steady_clock::time_point kill_at_;
  std::chrono::steady_clock::time_point give_up_at_;
};

}  // namespace shoal::launcher
