#include "launcher/worker_group.h"

#include <cstdio>
#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <fcntl.h>

#include <cerrno>
#include <cstring>
#include <optional>

#include "launcher/line_prefixer.h"
#include "launcher/signal_relay.h"
#include "log/error_file.h"
#include "shoal/error.h"
#include "shoal/log.h"

namespace shoal::launcher {

using Clock = std::chrono::steady_clock;

WorkerGroup::WorkerGroup(std::vector<WorkerSpec> specs, WorkerGroupOptions options)
    : specs_(std::move(specs)), options_(options) {}

WorkerGroup::~WorkerGroup() {
  stop_now();
  for (auto& prefixer : prefixers_) prefixer->flush();
  for (int fd : log_fds_) ::close(fd);
}

int WorkerGroup::count_running() const {
  return static_cast<int>(std::count_if(workers_.begin(), workers_.end(),
                                        [](const auto& w) { return w->running(); }));
}

void WorkerGroup::signal_all(int signal) {
  for (auto& worker : workers_) worker->signal_group(signal);
}

std::vector<int> WorkerGroup::pids() const { return pids_; }

void WorkerGroup::begin_stop(int signal, Clock::time_point now) {
  stopping_ = true;
  kill_at_ = now + options_.grace_period;
  signal_all(signal);
  // A stopped worker (SIGSTOP, Ctrl-Z, a debugger) would hold the signal pending until the grace
  // period ends in SIGKILL: continue it so that it acts on the signal now (as shells do).
  signal_all(SIGCONT);
}

// Kills whatever is left and reaps it (bounded): the group leaves no process and no zombie.
void WorkerGroup::stop_now() {
  if (count_running() > 0) signal_all(SIGKILL);
  workers_.clear();  // each WorkerProcess kills and reaps its own, bounded
}

void WorkerGroup::read_output(int max_rounds) {
  char buffer[65536];
  for (size_t i = 0; i < workers_.size(); ++i) {
    WorkerProcess& worker = *workers_[i];
    for (int stream = 0; stream < 2; ++stream) {
      const int fd = stream == 0 ? worker.stdout_fd() : worker.stderr_fd();
      if (fd < 0) continue;
      LinePrefixer& prefixer = *prefixers_[2 * i + stream];
      // Bounded rounds: one chatty worker cannot starve the loop (signals, the others' output).
      for (int round = 0; round < max_rounds; ++round) {
        const ssize_t n = ::read(fd, buffer, sizeof(buffer));
        if (n > 0) {
          prefixer.feed(buffer, static_cast<size_t>(n));
          continue;
        }
        if (n < 0 && errno == EINTR) continue;
        if (n == 0 || (n < 0 && errno != EAGAIN)) {  // end of stream
          prefixer.flush();
          stream == 0 ? worker.close_stdout() : worker.close_stderr();
        }
        break;
      }
    }
  }
}

int WorkerGroup::running_workers() const {
  int n = 0;
  for (const auto& worker : workers_) n += worker->running() && worker->spec().role == "worker";
  return n;
}

void WorkerGroup::reap(GroupResult& result, Clock::time_point now) {
  for (size_t i = 0; i < workers_.size(); ++i) {
    WorkerProcess& worker = *workers_[i];
    if (!worker.running() || !worker.poll_exit()) continue;
    if (options_.on_exit) options_.on_exit(worker.spec().rank);
    if (stopping_ || worker.status().ok() || go_on_without(i, result)) continue;
    // The first failure seen: stop the others.
    first_exit_seen_us_ = log::epoch_us();
    result.outcome = GroupResult::Outcome::kWorkerFailed;
    result.failed_label = worker.spec().label;
    result.failed_pid = worker.pid();
    result.failed_status = worker.status();
    result.exit_code = worker.status().shell_code();
    result.stopped = count_running();
    begin_stop(SIGTERM, now);
  }
}

// True when there are other workers and every one of them exited 0: with none, a failure is not
// one "after the others finished" (a node of one worker, an elastic node's).
bool WorkerGroup::others_succeeded(size_t index) const {
  for (size_t i = 0; i < workers_.size(); ++i) {
    if (i != index && (workers_[i]->running() || !workers_[i]->status().ok())) return false;
  }
  return workers_.size() > 1;
}

bool WorkerGroup::go_on_without(size_t index, GroupResult& result) {
  const WorkerProcess& worker = *workers_[index];
  if (!options_.tolerate_worker_failures || worker.spec().role != "worker") return false;
  // A replica that fails once the others finished (a replacement too late to join, or one left
  // out after a stop) leaves the job as successful as the others made it.
  const bool replacement = replacements_.count(index) > 0;
  const bool late =
      (replacement || options_.replicas_finish_together) && others_succeeded(index);
  if (running_workers() == 0 && !late) return false;
  const std::string what = worker.spec().label + " (pid " + std::to_string(worker.pid()) + ") " +
                           worker.status().describe();
  if (late) {
    result.tolerated.push_back(what);
    log::warn(options_.log_name, ": ", what,
              replacement ? "; it replaced a failed worker, and the others had finished"
                          : "; it was not among the replicas that finished (was it stopped?), "
                            "and they had finished");
    return true;
  }
  if (static_cast<int>(result.replaced.size()) < options_.replace_failed_workers) {
    result.replaced.push_back(what);
    log::warn(options_.log_name, ": ", what, "; the other workers go on, and it is started ",
              "again to rejoin them (restart ", result.replaced.size(), " of at most ",
              options_.replace_failed_workers, ")");
    replace(index);
    return true;
  }
  result.tolerated.push_back(what);
  log::warn(options_.log_name, ": ", what, "; the other workers go on without it");
  return true;
}

void WorkerGroup::replace(size_t index) {
  read_output(/*max_rounds=*/64);  // what the one that ended wrote last
  for (int stream = 0; stream < 2; ++stream) prefixers_[2 * index + stream]->flush();
  const WorkerSpec spec = workers_[index]->spec();
  const bool capture =
      options_.prefix_output || !spec.stdout_file.empty() || !spec.stderr_file.empty();
  workers_[index] = std::make_unique<WorkerProcess>(spec, capture);
  workers_[index]->start();
  pids_.push_back(static_cast<int>(workers_[index]->pid()));
  replacements_.insert(index);
}

void WorkerGroup::name_first_failure(GroupResult& result) const {
  // Under tolerate_worker_failures earlier failures were gone on without: not the group's cause.
  if (result.outcome != GroupResult::Outcome::kWorkerFailed || options_.tolerate_worker_failures) {
    return;
  }
  int64_t first_at = first_exit_seen_us_;
  for (const auto& worker : workers_) {
    if (worker->pid() != result.failed_pid) continue;
    first_at = log::read_error_file(worker->spec().error_file).value_or(log::ErrorFile{}).time_us;
    if (first_at == 0) first_at = first_exit_seen_us_;
  }
  // Only a worker that left an error file can have failed before the first exit seen.
  for (const auto& worker : workers_) {
    if (worker->running() || worker->status().ok() || worker->pid() == result.failed_pid) continue;
    const std::optional<log::ErrorFile> error = log::read_error_file(worker->spec().error_file);
    if (!error || error->time_us >= first_at) continue;
    first_at = error->time_us;
    result.first_failed_label = worker->spec().label;
    result.first_failed_pid = worker->pid();
    result.first_failed_error = error->message;
  }
}

void WorkerGroup::show_first_error_line(const GroupResult& result) {
  // The worker whose error file's stamp shows it failed before the first exit seen, or else the
  // first exit seen when it left an error file (it failed first); without either, the first line
  // to arrive (a process that leaves no error file may have failed first).
  pid_t first = result.first_failed_pid;
  for (const auto& worker : workers_) {
    if (first < 0 && worker->pid() == result.failed_pid &&
        log::read_error_file(worker->spec().error_file)) {
      first = result.failed_pid;
    }
  }
  LinePrefixer* shown = nullptr;
  for (size_t i = 0; i < workers_.size(); ++i) {
    LinePrefixer* err = prefixers_[2 * i + 1].get();
    if (err->held_error_order() == 0) continue;
    if (workers_[i]->pid() == first) {
      shown = err;
      break;
    }
    if (shown == nullptr || err->held_error_order() < shown->held_error_order()) shown = err;
  }
  if (shown != nullptr) shown->show_held_error();
}

GroupResult WorkerGroup::run(SignalRelay& relay) {
  GroupResult result;
  // A group that goes on after a failure shows the first error line at once; one that stops
  // shows the line of the worker that failed first, once that is known (see SharedErrorLines).
  error_lines_.hold = !options_.tolerate_worker_failures;
  for (auto& spec : specs_) {
    const std::string prefix = options_.prefix_output ? "[" + spec.label + "] " : "";
    const bool logged = !spec.stdout_file.empty() || !spec.stderr_file.empty();
    prefixers_.push_back(std::make_unique<LinePrefixer>(
        prefix, spec.stdout_to_console ? STDOUT_FILENO : -1));
    prefixers_.push_back(std::make_unique<LinePrefixer>(
        prefix, spec.stderr_to_console ? STDERR_FILENO : -1));
    prefixers_.back()->set_error_lines(&error_lines_);
    for (int stream = 0; stream < 2; ++stream) {
      const std::string& path = stream == 0 ? spec.stdout_file : spec.stderr_file;
      if (path.empty()) continue;
      const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
      SHOAL_CHECK(fd >= 0, "cannot write ", spec.label, "'s log ", path, ": ",
                  std::strerror(errno), "; check --log-dir");
      log_fds_.push_back(fd);
      prefixers_[prefixers_.size() - 2 + stream]->set_copy(fd);
    }
    workers_.push_back(std::make_unique<WorkerProcess>(spec, options_.prefix_output || logged));
  }
  try {
    for (auto& worker : workers_) {
      worker->start();
      pids_.push_back(static_cast<int>(worker->pid()));
    }
  } catch (...) {
    stop_now();
    throw;
  }

  while (count_running() > 0) {
    auto now = Clock::now();
    auto wait = kPollInterval;
    if (stopping_ && !killed_) {
      wait = std::min(wait, std::max(std::chrono::duration_cast<std::chrono::milliseconds>(
                                         kill_at_ - now),
                                     std::chrono::milliseconds(0)));
    }
    std::vector<pollfd> fds{{relay.fd(), POLLIN, 0}};
    for (auto& worker : workers_) {
      for (int fd : {worker->stdout_fd(), worker->stderr_fd()}) {
        if (fd >= 0) fds.push_back({fd, POLLIN, 0});
      }
    }
    ::poll(fds.data(), fds.size(), static_cast<int>(wait.count()));
    now = Clock::now();

    for (int signal : relay.drain()) {
      if (signal == SIGCHLD) continue;  // reaped below
      if (signal == SIGUSR1) {
        // Workers start with SIGUSR1 ignored (worker_process.cpp) until init_process_group
        // installs the dump: one that never does is not killed by it.
        const int running = count_running();
        if (!stopping_ && running > 0) {
          signal_all(SIGUSR1);
          std::fprintf(stderr, "shoal run: received SIGUSR1; asked %d worker%s for their recent "
                       "operations\n", running, running == 1 ? "" : "s");
        }
        continue;
      }
      if (!stopping_) {
        result.outcome = GroupResult::Outcome::kInterrupted;
        result.interrupt_signal = signal;
        result.exit_code = 128 + signal;
        result.stopped = count_running();
        begin_stop(signal, now);  // forward the signal itself: the workers may handle it
      } else if (!killed_) {
        kill_at_ = now;  // a second signal: no more grace
        result.second_signal = true;
      }
    }
    read_output(/*max_rounds=*/16);
    reap(result, now);

    if (stopping_ && !killed_ && now >= kill_at_ && count_running() > 0) {
      result.killed = count_running();
      killed_ = true;
      give_up_at_ = now + kReapTimeout;
      signal_all(SIGKILL);
    }
    if (killed_ && now >= give_up_at_) {
      result.unreaped = count_running();
      break;
    }
  }
  // What the workers wrote just before they ended; a descendant that keeps a pipe open does not
  // hold the launcher up (non-blocking reads, bounded rounds).
  read_output(/*max_rounds=*/64);
  for (auto& prefixer : prefixers_) prefixer->flush();
  if (stopping_) signal_all(SIGKILL);  // leftovers in the workers' process groups
  name_first_failure(result);
  show_first_error_line(result);
  stop_now();
  return result;
}

}  // namespace shoal::launcher
