// BucketCapTuner: DistributedDataParallel's bucket_cap_mb = auto, the schedule that tries each
// candidate bucket cap on real steps and keeps the fastest.
//
// Each candidate cap is tried with the usual first bucket and with a first bucket of the same cap;
// candidates that give the same buckets are one. A slot of the schedule is one warm-up step (new
// buckets, their first reduction) and bucket_cap_tuning_steps timed ones, each from the end of
// one synchronised backward to the end of the next; the candidates take turns for
// bucket_cap_tuning_rounds rounds. Then every rank takes the slowest rank's median per candidate
// (one allreduce: the same choice everywhere) and the least of those wins. The Reducer builds the
// buckets the tuner asks for.
//
// Thread safety: driven by the Reducer's thread only.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "shoal/comm/process_group.h"
#include "shoal/parallel/distributed_data_parallel.h"

namespace shoal::parallel {

class BucketCapTuner {
 public:
  /// A first-bucket cap and the other buckets' cap, in MiB.
  struct Caps {
    double first_mb = 0;
    double cap_mb = 0;
  };
  /// The buckets (parameter indices per bucket) that caps would give.
  using LayoutOf = std::function<std::vector<std::vector<size_t>>(const Caps&)>;

  explicit BucketCapTuner(const DistributedDataParallelOptions& options) : options_(options) {}

  bool started() const { return started_; }
  bool done() const { return done_; }
  /// Each distinct candidate tried and its median step time (once done).
  const std::vector<ReducerStats::BucketCapTrial>& trials() const { return trials_; }

  /// Begins the schedule at synchronised step `step`; returns the caps to build first.
  Caps start(const LayoutOf& layout_of, int64_t step);
  /// At each rebuild point after start(), `step` synchronised steps done: the caps to build now
  /// (the next slot's candidate, or the winner once decided), or nullopt to keep the buckets.
  std::optional<Caps> advance(int64_t step, comm::ProcessGroup& group);
  /// A synchronised backward ended (a timed step's end while the schedule runs).
  void backward_ended();
  /// The trials as text for the log: "first/cap MiB ms, ...".
  std::string describe_trials() const;

 private:
  Caps decide(comm::ProcessGroup& group);

  DistributedDataParallelOptions options_;
  bool started_ = false;
  bool done_ = false;
  std::vector<Caps> caps_;                    // distinct candidates
  std::vector<std::vector<double>> samples_;  // per candidate: step seconds
  size_t slot_ = 0;                           // round * caps_.size() + candidate
  int64_t slot_start_ = 0;                    // the synchronised step the slot began at
  std::vector<std::chrono::steady_clock::time_point> ends_;  // backward ends in the slot
  std::vector<ReducerStats::BucketCapTrial> trials_;
};

}  // namespace shoal::parallel
