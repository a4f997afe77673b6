// The trainer's own callbacks: progress on the terminal, the metrics file, TensorBoard, the
// checkpoints and the trace, each told of the loop's events (FitLoop, train_loop.h) in the order
// the loop keeps. They see more than a user's Callback does (the epoch's sample counts, the
// metrics lines, why the run ended), so their interface is this internal one: what they read is
// the loop's business and may change with it, which a public header would freeze.
//
// Thread safety: one set per fit() call, used from the thread that runs it.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "shoal/trace/tracer.h"
#include "shoal/train/metrics_writer.h"
#include "shoal/train/strategy.h"
#include "shoal/train/trainer.h"

namespace shoal::train {

using FitClock = std::chrono::steady_clock;

inline double seconds_since(FitClock::time_point start) {
  return std::chrono::duration<double>(FitClock::now() - start).count();
}

/// Why fit() ended.
enum class StopReason {
  kNone,       ///< every epoch ran
  kCallback,   ///< a callback's request_stop() after a step: every rank agreed
  kEpochEnd,   ///< a callback's request_stop() after an epoch's evaluation
  kPreempted,  ///< options.stop_requested: every rank agreed
  kStepLimit,  ///< options.stop_after_steps
};

/// True when the run ended inside an epoch (that epoch is not complete).
bool stopped_mid_epoch(StopReason reason);

/// What stays the same over one fit().
struct FitInfo {
  const TrainOptions& options;
  Strategy& strategy;
  TrainState& state;
  int64_t batch = 0;     ///< samples of one step on one replica (batch_size x accumulate)
  int64_t replicas = 0;  ///< processes that train on distinct samples
  FitClock::time_point start = FitClock::now();
};

/// An epoch about to train.
struct EpochStart {
  int64_t epoch = 0;      ///< 0-based
  int64_t steps = 0;      ///< the steps this fit() trains of it (a resume skips some)
  int64_t samples = 0;    ///< the epoch's samples, all replicas together
  int64_t remaining = 0;  ///< of those, the ones this fit() trains
};

/// A step that trained, as the trainer's callbacks see it (not told of a step a callback stopped
/// the run after).
struct StepEnd {
  int64_t epoch = 0;   ///< 0-based
  int64_t index = 0;   ///< 1-based, within the epoch
  bool last = false;   ///< the epoch's last step
  int64_t done = 0;    ///< samples trained in the epoch by this fit(), all replicas together
  int64_t seen = 0;    ///< samples of the epoch consumed, a resume's included: where it resumes
  int64_t total = 0;   ///< samples of every epoch so far (the earlier epochs' and `seen`)
  double loss = 0;     ///< mean loss per sample since the last metrics line
  FitClock::time_point epoch_start;
  /// The step's metrics line at a log interval (MetricLines::step), else null.
  const JsonLine* line = nullptr;
};

/// An epoch evaluated.
struct EpochEnd {
  const EpochResult& result;
  const JsonLine& line;  ///< its metrics line
};

/// How fit() ended.
struct FitEnd {
  StopReason reason = StopReason::kNone;
  int64_t epoch = 0;  ///< 0-based: the epoch a mid-epoch stop ended in
  int64_t seen = 0;   ///< its samples consumed then (see StepEnd::seen)
};

/// One of the trainer's own callbacks. Called on every rank, in the loop's order.
class LoopCallback {
 public:
  virtual ~LoopCallback() = default;
  virtual void on_fit_start() {}
  virtual void on_epoch_start(const EpochStart& epoch) {}
  virtual void on_step_end(const StepEnd& step) {}
  virtual void on_epoch_end(const EpochEnd& epoch) {}
  virtual void on_fit_end(const FitEnd& end) {}
};

/// The metrics lines (the run's description, a line per log interval and per epoch): written by
/// MetricsWriter and read by TensorBoard. Built on every rank: a step line's gradient norm may be
/// a collective (FSDP's, over every rank's shards), and its communication figures are this rank's.
class MetricLines {
 public:
  explicit MetricLines(const FitInfo& fit);
  /// The run's description, from its first epoch: what `shoal plot` names the run by and scales
  /// its x axes with.
  JsonLine run(int64_t samples_per_epoch) const;
  /// Counts a step; at a log interval returns its line (per step over the interval, this rank's
  /// reductions).
  std::optional<JsonLine> after_step(const StepEnd& step);
  JsonLine epoch(const EpochResult& result, int64_t total_samples) const;

 private:
  void add_comm_stats(JsonLine& line);

  const FitInfo& fit_;
  std::optional<CommStats> comm_before_;
  int64_t comm_steps_ = 0;  // steps since comm_before_
};

/// The trainer's callbacks for `fit`, in the order the loop calls them: progress (over
/// `train_samples` per epoch), the metrics file (`lines`), TensorBoard, checkpoints (with
/// options.checkpoint_dir; `save` is Trainer::save_checkpoint), the trace (with
/// options.trace_path, recorded into `recorder`). Each keeps a reference to `fit` and `lines`.
std::vector<std::unique_ptr<LoopCallback>> make_loop_callbacks(
    const FitInfo& fit, const MetricLines& lines, int64_t train_samples,
    std::function<void(int64_t completed_epochs, int64_t samples_seen)> save,
    trace::Recorder* recorder);

}  // namespace shoal::train
