// HangReporter: on a time-out, every rank's last started and last completed operation, gathered
// through the store, so that one message shows who is behind and where:
//
//   every rank's last operations (gathered through the store in 0.4 s):
//     rank 0: started allreduce #5 (4 B float32, sum), in flight for 2.0 s; completed allreduce #4 (...)
//     rank 1: started allreduce #4 (4 B float32, sum), done; completed allreduce #4 (...)  <- behind
//     rank 2: no report (dead or stopped?)
//
// How: the rank whose operation failed increments the request counter "<scope>/hang/request",
// publishes its own summary under "<scope>/hang/<rank>" (tagged with the request number) and reads
// the others' for at most kHangReportBudget, taking an answer to any of the last `size` requests
// (the ranks that fail together each ask once; the first may answer and exit before the last
// asks). A report from the end of an earlier incident of the same group may so be shown. Every rank answers a request from a thread of its own
// (one per process, for every group), which looks at the counter every kHangPollInterval: so a
// rank that is blocked in a collective, or busy elsewhere and not calling any (the one that is
// behind), still answers; a rank that is dead or stopped does not, and the report says so.
//
// Heartbeat: the answering thread also increments "<scope>/alive/<rank>" at every poll. While a
// rank waits long in an operation it asks (silent_ranks()) for the other ranks whose heartbeat has
// stood still; the answering thread then reads every rank's counter at each poll, for as long as
// somebody keeps asking. A stopped process (SIGSTOP, a debugger) or a host cut off stops beating;
// a rank that is merely slow (evaluating, saving) keeps beating and is waited for.
//
// Cost: nothing on a collective's path (no allocation, no store traffic); off it, one small store
// request per group every kHangPollInterval; the report itself only when an operation failed.
//
// Thread safety: gather() from any thread; close() before the summarised object goes away.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "shoal/comm/op_label.h"
#include "shoal/comm/store.h"

namespace shoal::comm {

/// How long a failing rank waits for the others' reports. Why 2 s: several poll intervals for a
/// live rank to answer, short next to any time-out (the error must not come much later).
constexpr Milliseconds kHangReportBudget{2000};
/// How often each rank looks for a request. Why 0.5 s: answers well within the budget, at two
/// tiny store requests per second and group.
constexpr Milliseconds kHangPollInterval{500};
/// How much longer than the budget gather() waits for the store's own calls. Why 0.5 s: a store
/// that answers at all answers in milliseconds; one whose host is cut off would hold the error
/// for the store's whole time-out (the netns test: 40 s more).
constexpr Milliseconds kHangStoreSlack{500};

/// A rank whose heartbeat has stood still (rank -1: the store itself has not answered the watch).
struct Silence {
  int rank = -1;
  Milliseconds silent_for{0};
};

/// One rank's summary of its recent operations.
struct RankSummary {
  uint64_t last_started = 0;    ///< sequence number; 0: none yet
  uint64_t last_completed = 0;  ///< sequence number; 0: none yet
  /// "started allreduce #5 (...), in flight for 2.0 s; completed allreduce #4 (...)"
  std::string text;
};

class HangReporter : public std::enable_shared_from_this<HangReporter> {
 public:
  using Summarize = std::function<RankSummary()>;

  /// Starts answering requests for this rank (`summarize` is called on the answering thread and
  /// by gather()). `scope` keeps groups that share a store apart.
  static std::shared_ptr<HangReporter> create(std::shared_ptr<Store> store, std::string scope,
                                              int rank, int size, Summarize summarize);
  ~HangReporter();

  /// The table above, starting with a newline; empty when the store cannot be reached. Returns
  /// within `budget` (plus kHangStoreSlack) even when the store does not answer (its host cut
  /// off): the store calls run on a thread of their own, left to finish by themselves. Never throws.
  std::string gather(Milliseconds budget = kHangReportBudget);

  /// The ranks whose heartbeat has not moved for at least `limit`, as seen by this process's
  /// answering thread, which watches every rank's heartbeat for a few poll intervals after each
  /// call (so a waiter calls it every poll interval or so). Empty at the first calls (the watch
  /// needs `limit` to see silence) and when everyone beats. Never blocks on the store; never
  /// throws.
  std::vector<Silence> silent_ranks(Milliseconds limit);

  /// Stops calling `summarize`; returns once no call is running. Idempotent.
  void close();

  const std::shared_ptr<Store>& store() const { return store_; }
  const std::string& scope() const { return scope_; }

  /// For the answering thread: answers a new request, if any. False once the store is gone.
  bool poll();

 private:
  HangReporter(std::shared_ptr<Store> store, std::string scope, int rank, int size,
               Summarize summarize);
  /// gather()'s work, on its own thread: blocks as long as the store's calls do.
  std::string gather_through_store(Milliseconds budget);
  /// This rank's summary tagged with `request`, as stored; empty once closed.
  std::string encode(int64_t request);
  /// For the answering thread, while a watch is asked for: reads every rank's heartbeat.
  void watch_heartbeats();

  std::shared_ptr<Store> store_;
  std::string scope_;
  int rank_;
  int size_;
  std::mutex summarize_mutex_;  // held while summarize_ runs; close() takes it
  Summarize summarize_;
  bool closed_ = false;
  int64_t answered_ = 0;  // the answering thread's last answered request

  // The heartbeat watch, under beats_mutex_. beat_ is empty until the first reading of a watch.
  using TimePoint = std::chrono::steady_clock::time_point;
  std::mutex beats_mutex_;
  TimePoint watch_until_{};   // the answering thread watches until then
  TimePoint last_reading_{};  // the last complete reading of this watch (or its start)
  std::vector<int64_t> beat_;        // each rank's counter at the last reading
  std::vector<TimePoint> moved_at_;  // when each rank's counter was last seen to change
};

}  // namespace shoal::comm
