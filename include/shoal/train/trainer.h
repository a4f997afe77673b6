// The built-in trainer: deterministic SGD(+momentum) with cross-entropy on in-memory tensors,
// per-epoch evaluation, progress on stderr and JSON-lines metrics.
//
// The loop is made of separable pieces so that other strategies reuse them: train_step() does one
// optimizer step on one batch, evaluate() measures loss and accuracy, and Trainer::fit() strings
// them together, asking its Strategy which samples to visit and which forward to call (see
// strategy.h). run_training() is `shoal train` as a function: it loads Fashion-MNIST, builds the
// model and fits it.
//
// Determinism: with the same options, seed and thread count, two runs produce bit-identical
// parameters (initial weights and shuffles come from seeded generators; LibTorch's CPU kernels are
// deterministic for a fixed thread count).
//
// Thread safety: a Trainer and its TrainState are used from one thread.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include <functional>
#include <memory>
#include <vector>

#include "shoal/checkpoint/training_state.h"
#include "shoal/models/model.h"
#include "shoal/train/strategy.h"
#include "shoal/train/train_options.h"

namespace shoal::train {

/// Inputs [N, ...] and integer class targets [N], both on the same device.
struct TensorData {
  at::Tensor inputs;
  at::Tensor targets;
  int64_t size() const { return inputs.defined() ? inputs.size(0) : 0; }
};

/// Everything one training step reads and changes.
struct TrainState {
  /// The model being trained (its parameters are what the optimizer updates).
  std::shared_ptr<models::Model> model;
  /// The optimizer over model's parameters.
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  /// What a forward pass calls: the model itself, or a wrapper set by Strategy::prepare.
  std::function<at::Tensor(const at::Tensor&)> forward;
  /// The current epoch, 0-based (shown 1-based to users).
  int64_t epoch = 0;
  /// Optimizer steps taken so far, over all epochs.
  int64_t step = 0;
};

/// Loss and accuracy over a dataset.
struct EvalResult {
  double loss = 0;      ///< mean cross-entropy per sample
  double accuracy = 0;  ///< fraction of samples whose argmax logit is the target
  int64_t samples = 0;
};

/// What one epoch achieved.
struct EpochResult {
  int64_t epoch = 0;  ///< 1-based
  double train_loss = 0;
  double test_loss = 0;
  double test_accuracy = 0;
  double samples_per_s = 0;  ///< training samples per second, all processes together
  double seconds = 0;        ///< training time of the epoch, evaluation excluded
};

/// What a whole run achieved.
struct TrainResult {
  std::vector<EpochResult> epochs;
  /// True when options.stop_after_steps ended the run early (as an interruption would).
  bool stopped = false;
  /// Test accuracy after the last epoch.
  double final_test_accuracy() const { return epochs.empty() ? 0 : epochs.back().test_accuracy; }
};

/// One SGD step on a batch: zero_grad, forward, cross-entropy, backward, optimizer step.
/// Returns the batch's mean loss. Increments state.step.
double train_step(TrainState& state, const at::Tensor& inputs, const at::Tensor& targets);

/// Mean cross-entropy and accuracy of `forward` on `data`, in batches of `batch_size`, without
/// autograd. Puts `model` in eval mode for the duration.
EvalResult evaluate(torch::nn::Module& model,
                    const std::function<at::Tensor(const at::Tensor&)>& forward,
                    const TensorData& data, int64_t batch_size);

/// Trains a model on in-memory tensors; see the file comment.
class Trainer {
 public:
  /// `strategy` defaults to SingleProcess. Builds SGD over the model's parameters.
  Trainer(TrainOptions options, std::shared_ptr<models::Model> model,
          std::unique_ptr<Strategy> strategy = nullptr);
  ~Trainer();

  /// Trains for options.epochs epochs on `train`, evaluating on `test` after each (skipped when
  /// `test` is empty). Reports progress and metrics as the options say.
  TrainResult fit(const TensorData& train, const TensorData& test);

  /// Loads the newest checkpoint of options.checkpoint_dir into the model and optimizer and
  /// continues from its epoch, step and sampler position: the interrupted epoch skips the samples
  /// the job had already consumed (counted over all ranks, so the world size may differ from the
  /// one that saved it; each rank skips samples_seen / world_size of its shard). Throws
  /// CheckpointError when there is no checkpoint or it was made for another model.
  /// Returns the checkpoint's path.
  std::string resume();

  TrainState& state() { return state_; }
  const TrainOptions& options() const { return options_; }

 private:
  TrainOptions options_;
  std::unique_ptr<Strategy> strategy_;
  /// Saves the current state (rank 0 writes; every rank calls). `samples_seen` counts the whole
  /// job's samples of the current epoch.
  void save_checkpoint(int64_t completed_epochs, int64_t samples_seen);

  TrainState state_;
  bool prepared_ = false;
  /// Samples of the current epoch the job consumed before it was resumed (all ranks together).
  int64_t resume_samples_seen_ = 0;
};

/// The newest checkpoint of options.checkpoint_dir, checked to be resumable by `options` (it
/// exists and was made for options.model); its path goes to `path` when given. Throws
/// CheckpointError with a one-line message otherwise.
checkpoint::TrainingState load_resume_checkpoint(const TrainOptions& options,
                                                 std::string* path = nullptr);

/// `shoal train`: sets the thread count, builds options.model, loads Fashion-MNIST from
/// options.data_dir and fits with `strategy` (SingleProcess when null). Throws InvalidArgument /
/// DataError with one-line messages.
TrainResult run_training(const TrainOptions& options,
                         std::unique_ptr<Strategy> strategy = nullptr);

}  // namespace shoal::train
