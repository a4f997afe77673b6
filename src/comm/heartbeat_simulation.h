// HeartbeatSimulation: the heartbeat of a job of N ranks, each rank a HangReporter with a TCP
// client of its own to a real store server, all in this process (the answering thread serves
// them as it serves one process's groups): the code a rank runs, without process groups, LibTorch
// work or N processes, so that N can reach thousands on one machine. For the test of the
// heartbeat's traffic and `shoal bench heartbeat`.
//
// Thread safety: the methods from one thread; the waiting runs on a thread of its own.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "comm/hang_reporter.h"
#include "shoal/comm/store.h"

namespace shoal::comm {

class HeartbeatSimulation {
 public:
  /// `ranks` ranks, each in `groups` groups spanning the job (the world group and, as under the
  /// hierarchical backend, more), group rank r being job rank r. Raises the process's open-file
  /// limit as far as allowed (two sockets per rank); throws when it cannot reach 2·ranks + 64.
  HeartbeatSimulation(int ranks, int groups);
  ~HeartbeatSimulation();

  int ranks() const { return static_cast<int>(reporters_.size()); }
  /// Store requests the ranks have sent so far.
  int64_t requests() const { return requests_.load(); }
  /// How often `rank` has beaten, read from the store.
  int64_t beats(int rank);

  /// From now on every rank but `busy` (busy elsewhere, yet beating) waits in collective
  /// `sequence` and asks the watch every kHangPollInterval whether a peer has been silent for
  /// `limit`, as a long Gloo wait does.
  void start_waiting(int busy, uint64_t sequence, Milliseconds limit);
  /// The rank `rank`'s watch named silent; -1 the store; kNone: none (yet).
  int named(int rank) const;
  static constexpr int kNone = -2;
  /// How many waiting ranks have named somebody.
  int naming() const;
  void stop_waiting();

  /// Every rank that is not stopped asks for a report at once, as all do after a collective's
  /// time-out; returns each asking rank's table (see HangReporter::gather), by rank.
  std::vector<std::string> gather_all(Milliseconds budget);
  /// Rank `rank` alone asks for a report.
  std::string gather(int rank, Milliseconds budget);

  /// `rank` stops as a process stopped by SIGSTOP would: it neither beats nor answers nor waits.
  void stop(int rank);

 private:
  std::atomic<int64_t> requests_{0};
  std::shared_ptr<Store> server_;
  std::mutex mutex_;  // over reporters_ and stopped_, between stop() and the waiting thread
  std::vector<std::vector<std::shared_ptr<HangReporter>>> reporters_;  // [rank][group]
  std::vector<std::atomic<int>> named_;
  std::vector<std::atomic<bool>> stopped_;
  std::atomic<bool> waiting_{false};
  std::thread waiter_;
};

}  // namespace shoal::comm
