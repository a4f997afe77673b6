// The built-in trainer: any torch::nn::Module, any LibTorch optimizer and loss (by default SGD with
// momentum and cross-entropy, as `shoal train`) on in-memory tensors, per-epoch evaluation,
// progress on stderr, JSON-lines metrics and an optional Chrome trace of every step.
//
//   auto net = std::make_shared<Net>();
//   shoal::train::Trainer trainer(options, net,
//       std::make_unique<torch::optim::Adam>(net->parameters(), torch::optim::AdamOptions(1e-3)),
//       [](const at::Tensor& out, const at::Tensor& y) { return torch::mse_loss(out, y); });
//
// The loop is made of separable pieces so that other strategies reuse them: train_step() does one
// optimizer step on one batch, evaluate() measures loss and accuracy, and Trainer::fit() strings
// them together, asking its Strategy which samples to visit and which forward to call (see
// strategy.h). run_training() is `shoal train` as a function: it loads the data (Fashion-MNIST,
// CIFAR-10's binary files, or a torch.save file of tensors), builds the model (a built-in one, or
// a TorchScript file) and fits it.
//
// Determinism: with the same options, seed and thread count, two runs produce bit-identical
// parameters (initial weights and shuffles come from seeded generators; LibTorch's CPU kernels are
// deterministic for a fixed thread count).
//
// Thread safety: a Trainer and its TrainState are used from one thread.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/pimpl.h>
#include <torch/optim/optimizer.h>

#include <cmath>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "shoal/checkpoint/checkpoint_manager.h"
#include "shoal/checkpoint/training_state.h"
#include "shoal/data/batch_dataset.h"
#include "shoal/trace/tracer.h"
#include "shoal/models/model.h"
#include "shoal/train/grad_scaler.h"
#include "shoal/train/loss.h"
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
  std::shared_ptr<torch::nn::Module> model;
  /// The model's own forward, unwrapped (evaluation calls it; training goes through `forward`).
  std::function<at::Tensor(const at::Tensor&)> model_forward;
  /// The optimizer over model's parameters.
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  /// The loss minimized on the forward's output.
  LossFunction loss = cross_entropy_loss;
  /// Set for a model that computes its own loss (models::Model::owns_loss): that loss, unwrapped
  /// (evaluation calls it). Training then minimizes `forward_loss`, and `loss` does not apply.
  BatchLoss model_loss;
  /// What a training step's loss goes through when model_loss is set: model_loss itself or a
  /// strategy's wrapper (Strategy::prepare; one that leaves it null does not train such models).
  BatchLoss forward_loss;
  /// What a forward pass calls: the model itself, or a wrapper set by Strategy::prepare.
  std::function<at::Tensor(const at::Tensor&)> forward;
  /// The current epoch, 0-based (shown 1-based to users).
  int64_t epoch = 0;
  /// Optimizer steps taken so far, over all epochs.
  int64_t step = 0;

  // ---- Accumulation, clipping and precision; the trainer sets them from its options ----
  /// > 0: train_step() splits its batch into micro-batches of this size, each backward adding to
  /// the gradients (its loss weighted by its share of the batch, i.e. loss / N for N equal
  /// micro-batches), and steps once. 0: the batch is one micro-batch.
  int64_t micro_batch_size = 0;
  /// Set by a data-parallel strategy: a scope in which backward does not reduce gradients
  /// (DDP's no_sync); train_step() holds it around every micro-batch but the last.
  std::function<std::shared_ptr<void>()> no_sync;
  /// > 0: the gradients are clipped to this global L2 norm before each optimizer step
  /// (clip_grad_norm_).
  double max_grad_norm = 0;
  /// How the global norm is clipped (the trainer's strategy: across stages under a pipeline);
  /// returns the norm before clipping. Null: clip_grad_norm_ over model's parameters.
  std::function<double(double max_norm)> clip_grad_norm;
  /// The last step's total gradient norm before clipping (NaN without clipping).
  double last_grad_norm = NAN;
  /// Set: the forward and the loss run under autocast to this type (bf16 or fp16) on the
  /// model's device.
  std::optional<c10::ScalarType> autocast_dtype;
  /// Where the model's parameters are (TrainOptions::device): each batch goes there, and
  /// autocast_dtype applies to that device's operators.
  at::Device device = at::kCPU;
  /// Set (--precision fp16): the loss is scaled before backward, the gradients unscaled before
  /// clipping, and a step with an inf/NaN gradient is skipped (torch.amp.GradScaler's recipe).
  std::unique_ptr<GradScaler> grad_scaler;
};

/// Loss and accuracy over a dataset.
struct EvalResult {
  double loss = 0;      ///< mean loss per sample
  double accuracy = 0;  ///< fraction of samples whose argmax logit is the target (NaN unless
                        ///< the outputs are [N, C] logits and the targets [N] classes)
  int64_t samples = 0;
};

/// What one epoch achieved.
struct EpochResult {
  int64_t epoch = 0;  ///< 1-based
  double train_loss = 0;
  double test_loss = 0;
  double test_accuracy = 0;
  /// exp(test_loss) for a model that computes its own loss (a language model's per-token
  /// negative log-likelihood); NaN otherwise.
  double test_perplexity = NAN;
  double samples_per_s = 0;  ///< training samples per second, all processes together
  double seconds = 0;        ///< training time of the epoch, evaluation excluded
};

// ---- Callbacks and early stopping ------------------------------------------------------

class Trainer;

/// What one optimizer step did, as a callback sees it.
struct StepInfo {
  int64_t epoch = 0;          ///< 1-based
  int64_t step = 0;           ///< optimizer steps so far (this one included)
  double loss = 0;            ///< the step's mean loss (this process's samples)
  double lr = 0;              ///< the first parameter group's lr this step trained at
  double grad_norm = NAN;     ///< total gradient norm before clipping (NaN without clipping)
};

struct TrainResult;

/// Called by Trainer::fit() on every process: when it starts, after every optimizer step, after
/// every epoch's evaluation and when it ends (the names of PyTorch Lightning's hooks). A callback
/// may call trainer.request_stop() to end the run: after the epoch's end (its checkpoint is
/// saved), or after the step when asked from on_train_batch_end (all processes stop at the same
/// step: the trainer agrees on it through one small all-reduce per step while callbacks are set).
class Callback {
 public:
  virtual ~Callback() = default;
  /// Before the first step, once per fit() call (the trainer's own reporters are set up).
  virtual void on_fit_start(Trainer& trainer) {}
  virtual void on_train_batch_end(Trainer& trainer, const StepInfo& step) {}
  virtual void on_train_epoch_end(Trainer& trainer, const EpochResult& epoch) {}
  /// Once per fit() call, however the run ended (every epoch, a stop request, stop_after_steps),
  /// unless by an exception; the run's checkpoint and trace are written. `result` is what fit()
  /// returns.
  virtual void on_fit_end(Trainer& trainer, const TrainResult& result) {}
};

/// Early stopping on an epoch metric (Lightning's EarlyStopping): stops when `monitor` has not
/// improved by more than min_delta for `patience` epochs in a row.
struct EarlyStoppingOptions {
  /// "test_loss", "test_accuracy" or "train_loss".
  std::string monitor = "test_loss";
  /// "min" (lower is better) or "max".
  std::string mode = "min";
  int64_t patience = 3;
  double min_delta = 0;
};

class EarlyStopping : public Callback {
 public:
  explicit EarlyStopping(EarlyStoppingOptions options = {});
  void on_train_epoch_end(Trainer& trainer, const EpochResult& epoch) override;
  /// The best value seen, and the epochs since it (wait_count in Lightning).
  double best() const { return best_; }
  int64_t wait_count() const { return wait_count_; }
  /// The epoch (1-based) after which it asked to stop; 0 while it has not.
  int64_t stopped_epoch() const { return stopped_epoch_; }

 private:
  EarlyStoppingOptions options_;
  double best_ = NAN;
  int64_t wait_count_ = 0;
  int64_t stopped_epoch_ = 0;
};

/// What a whole run achieved.
struct TrainResult {
  std::vector<EpochResult> epochs;
  /// True when options.stop_after_steps ended the run early (as an interruption would).
  bool stopped = false;
  /// True when options.stop_requested ended the run (a checkpoint was saved at `step`).
  bool preempted = false;
  /// True when a callback's request_stop() ended the run (early stopping).
  bool early_stopped = false;
  int64_t step = 0;
  /// Test accuracy after the last epoch.
  double final_test_accuracy() const { return epochs.empty() ? 0 : epochs.back().test_accuracy; }
};

/// One optimizer step on a batch: zero_grad, forward, loss, backward, optimizer step.
/// Returns the batch's mean loss. Increments state.step. Throws shoal::Error when the loss is not
/// finite (training diverged: the learning rate is too high, or the data holds NaN/inf).
double train_step(TrainState& state, const at::Tensor& inputs, const at::Tensor& targets);

/// Mean loss and accuracy of `forward` on `data`, in batches of `batch_size`, without
/// autograd. Puts `model` in eval mode for the duration.
EvalResult evaluate(torch::nn::Module& model,
                    const std::function<at::Tensor(const at::Tensor&)>& forward,
                    const TensorData& data, int64_t batch_size,
                    const LossFunction& loss = cross_entropy_loss);

/// The same over any dataset read a batch at a time (a lazily read one, data/batch_dataset.h),
/// through a DataLoader without workers.
EvalResult evaluate(torch::nn::Module& model,
                    const std::function<at::Tensor(const at::Tensor&)>& forward,
                    const data::BatchDataset& data, int64_t batch_size,
                    const LossFunction& loss = cross_entropy_loss);

/// Mean loss of a model that computes its own (`model_loss`, see TrainState::model_loss) on
/// `data`, as evaluate() above; the accuracy is NaN.
EvalResult evaluate_model_loss(torch::nn::Module& model, const BatchLoss& model_loss,
                               const data::BatchDataset& data, int64_t batch_size);

/// Trains a model on in-memory tensors or any BatchDataset; see the file comment.
namespace detail {
TrainResult run_validated_training(const TrainOptions& options, std::unique_ptr<Strategy> strategy,
                                   std::optional<checkpoint::ResumePoint> resume_from);
}  // namespace detail

class Trainer {
 public:
  /// `strategy` defaults to SingleProcess. Builds the options' optimizer over the model's
  /// parameters and minimizes options.loss on its output, or the model's own loss when it
  /// computes one (models::Model::owns_loss).
  Trainer(TrainOptions options, std::shared_ptr<models::Model> model,
          std::unique_ptr<Strategy> strategy = nullptr);

  /// Any module with `at::Tensor forward(at::Tensor)`, any optimizer over its parameters, any loss
  /// (options.lr and options.momentum are then the optimizer's business, not the trainer's).
  template <typename ModuleType>
  Trainer(TrainOptions options, std::shared_ptr<ModuleType> module,
          std::unique_ptr<torch::optim::Optimizer> optimizer, LossFunction loss = cross_entropy_loss,
          std::unique_ptr<Strategy> strategy = nullptr)
      : Trainer(std::move(options), module,
                [module](const at::Tensor& input) { return module->forward(input); },
                std::move(optimizer), std::move(loss), std::move(strategy)) {}
  template <typename ModuleType>
  Trainer(TrainOptions options, torch::nn::ModuleHolder<ModuleType> module,
          std::unique_ptr<torch::optim::Optimizer> optimizer, LossFunction loss = cross_entropy_loss,
          std::unique_ptr<Strategy> strategy = nullptr)
      : Trainer(std::move(options), module.ptr(), std::move(optimizer), std::move(loss),
                std::move(strategy)) {}

  /// A module that computes its own loss (a language model's forward(idx, targets)): training
  /// minimizes `model_loss` of each batch, evaluation reports its mean (no accuracy).
  Trainer(TrainOptions options, std::shared_ptr<torch::nn::Module> module, BatchLoss model_loss,
          std::unique_ptr<torch::optim::Optimizer> optimizer,
          std::unique_ptr<Strategy> strategy = nullptr);

  /// The type-erased form of the constructors above: `forward` calls the module.
  Trainer(TrainOptions options, std::shared_ptr<torch::nn::Module> module,
          std::function<at::Tensor(const at::Tensor&)> forward,
          std::unique_ptr<torch::optim::Optimizer> optimizer, LossFunction loss,
          std::unique_ptr<Strategy> strategy);
  ~Trainer();

  /// Trains for options.epochs epochs on `train`, evaluating on `test` after each (skipped when
  /// `test` is empty). Reports progress and metrics as the options say.
  TrainResult fit(const TensorData& train, const TensorData& test);
  /// The same over datasets read a batch at a time (in memory, or lazily from files): each epoch's
  /// samples (the strategy's sampler shard) are loaded by a DataLoader with options.num_workers
  /// threads, options.prefetch_factor batches each ahead of the step. `test` may be null. Visits
  /// the same samples in the same order as fit(TensorData), so the weights are the same.
  TrainResult fit(const data::BatchDataset& train, const data::BatchDataset* test);

  /// Loads the newest checkpoint of options.checkpoint_dir into the model and optimizer and
  /// continues from its epoch, step and sampler position: the interrupted epoch goes on after the
  /// samples the job had already consumed (the first samples_seen of the epoch's order, counted
  /// over all ranks), the rest of the order dealt over the ranks there are now, so the world size
  /// may differ from the one that saved it and each sample of the rest is trained once. Throws
  /// CheckpointError when there is no checkpoint or it was made for another model.
  /// Returns the checkpoint's path.
  /// The options' lr and momentum apply to the resumed SGD (not the checkpoint's); with an
  /// optimizer given by the caller, its restored hyper-parameters stay.
  std::string resume();
  /// resume() from a checkpoint already read by load_resume_checkpoint.
  std::string resume(checkpoint::ResumePoint point);
  /// After resume(): the hyper-parameters that differ from the checkpoint's config, as
  /// "lr 0.05 -> 0.01, ..." (empty when none).
  const std::string& resume_changes() const { return resume_changes_; }

  TrainState& state() { return state_; }
  const TrainOptions& options() const { return options_; }

  /// Adds a callback (see Callback); called in the order added.
  void add_callback(std::shared_ptr<Callback> callback);
  /// Ends fit() after the current step or epoch (see Callback).
  void request_stop() { stop_requested_ = true; }

 private:
  /// Marks options that passed TrainOptions::validate(): the public constructors check them once
  /// and delegate to the private ones, which run_validated_training (given checked options)
  /// calls directly.
  struct Validated {};
  Trainer(Validated, TrainOptions options, std::shared_ptr<models::Model> model,
          std::unique_ptr<Strategy> strategy);
  Trainer(Validated, TrainOptions options, std::shared_ptr<torch::nn::Module> module,
          std::function<at::Tensor(const at::Tensor&)> forward,
          std::unique_ptr<torch::optim::Optimizer> optimizer, LossFunction loss,
          std::unique_ptr<Strategy> strategy);
  friend TrainResult detail::run_validated_training(const TrainOptions& options,
                                                    std::unique_ptr<Strategy> strategy,
                                                    std::optional<checkpoint::ResumePoint> resume_from);

  /// resume()'s work once the checkpoint is read; returns its path.
  std::string restore(checkpoint::ResumePoint point);

  TrainOptions options_;
  std::unique_ptr<Strategy> strategy_;
  /// Saves the current state (rank 0 writes; every rank calls). `samples_seen` counts the whole
  /// job's samples of the current epoch.
  void save_checkpoint(int64_t completed_epochs, int64_t samples_seen);
  /// This trainer's timeline (made on first use) while options.trace_path is set, else null.
  trace::Recorder* recorder();
  /// fit()'s loop (train_loop.h) runs on this trainer's state, strategy and callbacks.
  friend class FitLoop;

  TrainState state_;
  /// True when the trainer built the optimizer itself (SGD from options.lr and momentum).
  bool builtin_optimizer_ = false;
  bool prepared_ = false;
  /// Samples of the current epoch the job consumed before it was resumed (all ranks together).
  int64_t resume_samples_seen_ = 0;
  /// Each parameter group's learning rate as given: the schedule's base values.
  std::vector<double> base_lrs_;
  /// Strategy::prepare, once, and what follows from it (fit() calls it before the first step).
  void prepare_strategy();
  /// Sets every parameter group's lr for the coming step of `total_steps` (lr_schedule).
  void apply_lr_schedule(int64_t total_steps);
  std::string resume_changes_;
  // A resumed fp16 scaler's state, loaded into the scaler that the next fit() makes.
  std::optional<std::map<std::string, double>> pending_scaler_state_;
  /// This trainer's timeline while options.trace_path is set (see trace::Recorder).
  std::unique_ptr<trace::Recorder> recorder_;
  // Callbacks.
  std::vector<std::shared_ptr<Callback>> callbacks_;
  bool stop_requested_ = false;
  /// Sets state_'s accumulation, clipping and precision from the options (fit() calls it).
  void apply_training_features();
};

/// The newest intact checkpoint of options.checkpoint_dir and its path, checked to be resumable
/// by `options` (it exists and was made for options.model). Throws CheckpointError with a one-line
/// message otherwise.
checkpoint::ResumePoint load_resume_checkpoint(const TrainOptions& options);

/// For a resumed run: the hyper-parameters not named in `given` ("lr", "momentum", "optimizer",
/// "batch_size", "epochs", "seed") are set from the checkpoint's config, so that a resume continues as the run
/// was configured; those given are kept (and applied). A given seed that differs from the
/// checkpoint's is refused (InvalidArgument): it would change the order of the samples. `where`
/// names the checkpoint in messages.
void inherit_checkpoint_config(TrainOptions& options, const checkpoint::TrainingState& saved,
                               const std::set<std::string>& given, const std::string& where);

/// The optimizer options.optimizer chooses (SGD, Adam or AdamW) over `parameters` (each tensor
/// once: tied weights are one parameter), with the options' lr, momentum, betas, eps and
/// weight decay; the options are checked first (InvalidArgument).
std::unique_ptr<torch::optim::Optimizer> make_optimizer(const TrainOptions& options,
                                                        const std::vector<at::Tensor>& parameters);

/// `shoal train`: sets the thread count, loads options.data_path (a torch.save dict of tensors)
/// or options.data_dir (CIFAR-10's binary files when present, else Fashion-MNIST), builds
/// options.model (a built-in model for the data's sample shape, or a TorchScript file) and fits with `strategy` (SingleProcess when null). Throws InvalidArgument /
/// DataError with one-line messages.
TrainResult run_training(const TrainOptions& options,
                         std::unique_ptr<Strategy> strategy = nullptr);

namespace detail {
/// run_training for options that passed TrainOptions::validate() in this process (`shoal train`
/// checks them once, before it launches a job or reads a checkpoint). A --resume goes on from
/// `resume_from` when given (the checkpoint the options were inherited from, so that it is read
/// once and is the same one), else from the one load_resume_checkpoint finds. Not API: a caller
/// that skips the checks gets no error for options that make no sense.
TrainResult run_validated_training(const TrainOptions& options, std::unique_ptr<Strategy> strategy,
                                   std::optional<checkpoint::ResumePoint> resume_from = std::nullopt);
}  // namespace detail

}  // namespace shoal::train
