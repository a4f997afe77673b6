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
// the others' for at most kHangReportBudget, with one batched request a round (each member puts a
// placeholder there when its group forms), taking an answer to any of the last `size` requests
// (the ranks that fail together each ask once; the first may answer and exit before the last
// asks). A report from the end of an earlier incident of the same group may so be shown. Every rank answers a request from a thread of its own
// (one per process, for every group), which looks at the counter every kHangPollInterval: so a
// rank that is blocked in a collective, or busy elsewhere and not calling any (the one that is
// behind), still answers; a rank that is dead or stopped does not, and the report says so.
//
// Heartbeat, one store request per beat and process: the answering thread adds 1 to
// "shoal/beat/<job rank>" every beat_interval(), once for all the groups this process has on one
// store (each group maps its ranks to job ranks). Asking for a report also goes through that
// counter: after kAskGrace one asking rank of the incident adds kRequestUnit to each member that
// has not answered, so a beat's answer tells whether anybody asked, and only then are the groups'
// request counters read. At rest, so, a process sends one request per beat whatever the number
// of its groups and ranks; a report costs O(N) requests in all, however many ranks ask.
//
// The watch: while a rank waits long in a collective it asks (silent_ranks()) whether the
// kWatchedSuccessors ranks after it in the group (a ring) have stopped beating; the answering
// thread then reads those counters at each beat, and the one key "<scope>/silent/<operation>"
// where a watcher that found a silent rank has written it, so that every waiter of the operation
// names that rank. O(N) store requests per round in all, where every rank reading every other
// rank's counter was O(N²). A stopped process (SIGSTOP, a debugger) or a host cut off stops
// beating; a rank that is merely slow (evaluating, saving) keeps beating and is waited for.
//
// Cost: nothing on a collective's path (no allocation, no store traffic); off it, one small store
// request per process every beat_interval(); the report itself only when an operation failed.
//
// Thread safety: gather() from any thread; close() before the summarised object goes away.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "shoal/comm/op_label.h"
#include "shoal/comm/store.h"

namespace shoal::comm {

/// How long a failing rank waits for the others' reports. Why 2 s: several poll intervals for a
/// live rank to answer, short next to any time-out (the error must not come much later).
constexpr Milliseconds kHangReportBudget{2000};
/// How often a long wait looks at the watch (NativeBackedWork's slices). Why 0.5 s: a wait that
/// long is already unusual; a stopped peer is named well within the heartbeat limit.
constexpr Milliseconds kHangPollInterval{500};
/// How many ranks after it in its group a waiting rank watches. Why 2: a stopped rank is found
/// unless both ranks before it in the ring are stopped or not waiting too; then the rank before
/// those finds one of them, and one silent rank fails the operation for all.
constexpr int kWatchedSuccessors = 2;
/// Added to a rank's beat counter to ask it for a report (the beats count in the low 32 bits:
/// 136 years at one a second).
constexpr int64_t kRequestUnit = int64_t{1} << 32;

/// How often a process beats and looks for requests: a quarter of silent_peer_timeout(), from
/// 0.25 s to 1 s. Why: a rank that beats is never seen still for the whole limit (a reading and a
/// beat may each come one interval late), and at the default limit (10 s) a process sends one
/// request a second.
Milliseconds beat_interval();
/// How long a report waits before it asks the ranks that have not answered by themselves. Why
/// 50 ms: ranks that fail together (a collective's time-out) answer within it by asking, and each
/// rank asked costs a store request; a rank asked answers at its next beat, well inside
/// kHangReportBudget.
constexpr Milliseconds kAskGrace{50};
/// The longest pause between a report's readings (they start 5 ms apart and double). Why 250 ms:
/// when all N ranks ask together, each reads every round, so the rounds a budget allows are the
/// report's cost (about a dozen in kHangReportBudget).
constexpr Milliseconds kReportPollCap{250};
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
  /// by gather()). `scope` keeps groups that share a store apart. `job_ranks[r]` is the job rank
  /// (the world group's rank, whose counter beats) of group rank r; empty: r itself.
  static std::shared_ptr<HangReporter> create(std::shared_ptr<Store> store, std::string scope,
                                              int rank, int size, Summarize summarize,
                                              std::vector<int> job_ranks = {});
  ~HangReporter();

  /// The table above, starting with a newline; empty when the store cannot be reached. Returns
  /// within `budget` (plus kHangStoreSlack) even when the store does not answer (its host cut
  /// off): the store calls run on a thread of their own, left to finish by themselves. Never throws.
  std::string gather(Milliseconds budget = kHangReportBudget);

  /// The watched ranks (see the file comment) whose heartbeat has not moved for at least `limit`,
  /// or the one another waiter of collective number `sequence` found, as seen by this process's
  /// answering thread, which watches for a few beats after each call (so a waiter calls it every
  /// kHangPollInterval or so). Empty at the first calls (the watch needs `limit` to see silence)
  /// and when everyone beats. Never blocks on the store; never throws.
  std::vector<Silence> silent_ranks(Milliseconds limit, uint64_t sequence);

  /// Stops calling `summarize`; returns once no call is running. Idempotent.
  void close();

  const std::shared_ptr<Store>& store() const { return store_; }
  /// The job rank of group rank `rank` (see create()).
  int job_rank(int rank) const;
  const std::string& scope() const { return scope_; }

  /// The counter this rank beats on ("shoal/beat/<job rank>"); the answering thread adds to it.
  const std::string& beat_key() const { return beat_keys_[rank_]; }
  /// The counter group rank `rank` beats on.
  const std::string& beat_key(int rank) const { return beat_keys_[rank]; }
  /// For the answering thread, after a beat told that somebody asked: answers a new request, if
  /// any. False once the store is gone or the group closed.
  bool answer();
  /// For the answering thread, after each beat, while a watch is asked for: reads the watched
  /// ranks' counters and the operation's silent key. False once the store is gone.
  bool watch();

 private:
  HangReporter(std::shared_ptr<Store> store, std::string scope, int rank, int size,
               Summarize summarize, std::vector<int> job_ranks);
  /// gather()'s work, on its own thread: blocks as long as the store's calls do.
  std::string gather_through_store(Milliseconds budget);
  /// Where group rank `rank` publishes its report ("<scope>/hang/<rank>").
  std::string report_key(int rank) const;
  /// This rank's summary tagged with `request`, as stored; empty once closed.
  std::string encode(int64_t request);
  /// The group ranks a waiting rank watches: the next kWatchedSuccessors in the ring.
  std::vector<int> watched_ranks() const;

  std::shared_ptr<Store> store_;
  std::string scope_;
  int rank_;
  int size_;
  std::vector<int> job_ranks_;          // each group rank's job rank
  std::vector<std::string> beat_keys_;  // each group rank's counter, "shoal/beat/<job rank>"
  std::mutex summarize_mutex_;  // held while summarize_ runs; close() takes it
  Summarize summarize_;
  bool closed_ = false;
  int64_t answered_ = 0;  // the answering thread's last answered request

  // The heartbeat watch, under beats_mutex_. beat_ is empty until the first reading of a watch.
  using TimePoint = std::chrono::steady_clock::time_point;
  std::mutex beats_mutex_;
  TimePoint watch_until_{};   // the answering thread watches until then
  TimePoint last_reading_{};  // the last complete reading of this watch (or its start)
  uint64_t watched_sequence_ = 0;    // the collective whose waiters the watch serves
  std::vector<int64_t> beat_;        // each watched rank's beats at the last reading
  std::vector<TimePoint> moved_at_;  // when each watched rank's counter was last seen to change
  std::optional<Silence> found_;    // a silent rank another waiter found
  std::optional<Silence> publish_;  // one this rank found, for the other waiters
  bool published_ = false;
};

}  // namespace shoal::comm
