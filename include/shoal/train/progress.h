// Training progress on a terminal or in a log: a live one-line bar (progress, loss, samples/s,
// ETA) when the stream is a terminal, plain periodic lines otherwise, and a summary per epoch.
//
// Thread safety: not thread-safe; used from the training thread only.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>

#include "shoal/train/train_options.h"

namespace shoal::train {

struct EpochResult;

/// Draws training progress on `out` (stderr by default) and epoch summaries on `summary_out`.
class Progress {
 public:
  /// `mode` kAuto picks kBar when `out` is a terminal, else kLines. `total_samples` counts every
  /// epoch (for the ETA). Summaries go to `summary_out` unless it is null.
  Progress(ProgressMode mode, int64_t epochs, int64_t total_samples, int64_t log_interval,
           std::FILE* out = stderr, std::FILE* summary_out = stdout);

  /// The mode in effect (kAuto resolved).
  ProgressMode mode() const { return mode_; }

  /// A new epoch (0-based) of `steps` steps over `samples` samples begins.
  void start_epoch(int64_t epoch, int64_t steps, int64_t samples);
  /// Step `step` (1-based, within the epoch) finished; `samples` done so far in the epoch;
  /// `loss` the mean loss of recent steps.
  void step(int64_t step, int64_t samples, double loss);
  /// The epoch finished: clears the bar and prints the summary.
  void end_epoch(const EpochResult& result);

 private:
  using Clock = std::chrono::steady_clock;
  void draw_bar(int64_t step, int64_t samples, double loss, bool force);
  double rate() const;  // training samples per second so far, over all epochs

  ProgressMode mode_;
  int64_t epochs_;
  int64_t total_samples_;
  int64_t log_interval_;
  std::FILE* out_;
  std::FILE* summary_out_;
  int64_t epoch_ = 0;
  int64_t epoch_steps_ = 0;
  int64_t epoch_samples_ = 0;
  int64_t done_before_epoch_ = 0;  // samples of finished epochs
  int64_t done_ = 0;               // samples of all epochs so far
  double trained_seconds_before_epoch_ = 0;
  Clock::time_point epoch_start_;
  Clock::time_point last_draw_;
  bool bar_visible_ = false;
};

}  // namespace shoal::train
