// The loop of Trainer::fit(): epochs of steps, each epoch evaluated, reported to the trainer's own
// callbacks (callbacks.h) and to the user's (Callback).
//
// A step: the batch, the lr schedule and the strategy's train step; the user's callbacks see it;
// every rank agrees in one all-reduce whether to stop (a callback's request_stop(), or
// options.stop_requested: a preemption), and options.stop_after_steps ends the run alike on every
// rank; unless a callback stopped it, the trainer's callbacks report the step (progress, metrics,
// TensorBoard, a periodic checkpoint). An epoch's end: evaluation, the trainer's callbacks
// (progress, metrics, TensorBoard, the checkpoint), then the user's, whose request_stop() ends the
// run there (its metrics are the same on every rank, so they decide alike). Every way out of the
// loop goes through finish(): the stop's checkpoint, the trace, the parameters dump, on_fit_end.
//
// Thread safety: one FitLoop per fit() call, used from the thread that makes it.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "shoal/data/batch_dataset.h"
#include "shoal/data/data_loader.h"
#include "shoal/train/trainer.h"
#include "train/callbacks.h"

namespace shoal::train {

/// The samples of a dataset of `size` that a run uses: the first `limit` (0: all;
/// options.train_limit, options.test_limit).
int64_t samples_used(int64_t limit, int64_t size);

class FitLoop {
 public:
  /// `trainer` is prepared (its strategy's prepare() done); `test` may be empty.
  FitLoop(Trainer& trainer, const data::BatchDataset& train, const data::BatchDataset& test);
  ~FitLoop();
  FitLoop(const FitLoop&) = delete;
  FitLoop& operator=(const FitLoop&) = delete;

  /// Trains from the trainer's state to options.epochs, or until something stops the run.
  TrainResult run();

 private:
  struct Epoch;
  StopReason run_epoch();
  StopReason run_dealt_epoch(StepDealer& dealer);
  StepInfo train_dealt(Epoch& epoch, const at::Tensor& share);
  Epoch start_epoch();
  StepInfo train_one(Epoch& epoch);
  StopReason end_step(Epoch& epoch, int64_t index, const StepInfo& step);
  StopReason agree_to_stop(const StepInfo& step);
  /// Reports step `index` (0-based), which trained `count` samples on this rank; `done`: the
  /// epoch's samples this fit() trained so far, all replicas together.
  void report_step(Epoch& epoch, int64_t index, double loss, int64_t count, int64_t done);
  void end_epoch(const Epoch& epoch);
  EpochResult evaluate_epoch(const Epoch& epoch, double seconds);
  EvalResult evaluate_shard(int64_t epoch);
  TrainResult finish(StopReason reason);

  Trainer& trainer_;
  const TrainOptions& options_;
  Strategy& strategy_;
  TrainState& state_;
  const data::BatchDataset& train_;
  int64_t train_n_;  // training samples used (options.train_limit)
  int64_t test_n_;   // test samples used (options.test_limit)
  data::SubsetDataset test_shard_;
  FitInfo fit_;
  MetricLines lines_;
  std::vector<std::unique_ptr<LoopCallback>> callbacks_;
  TrainResult result_;
  FitEnd stop_;  // where a stop after the latest step would leave the run
};

}  // namespace shoal::train
