// What the built-in trainer does: the hyper-parameters and the run's plumbing (data, threads,
// metrics, progress), with the defaults of `shoal train`.
//
// Thread safety: a plain value type.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

namespace shoal::train {

/// How training progress is shown on stderr.
enum class ProgressMode {
  kAuto,   ///< a live bar when stderr is a terminal, else plain lines
  kBar,    ///< a single line redrawn in place: progress, loss, samples/s, ETA
  kLines,  ///< one plain line every log_interval steps (for logs and pipes)
  kNone,   ///< nothing but the per-epoch summaries
};

/// Options of a training run. The defaults are those of `shoal train`; they were measured to reach
/// >= 0.85 Fashion-MNIST test accuracy with the CNN in one epoch on two CPU cores.
struct TrainOptions {
  /// A name known to shoal::models::create ("cnn", "mlp"), or a TorchScript file's path
  /// (models::is_script_path).
  std::string model = "cnn";
  /// Passes over the training set.
  int64_t epochs = 1;
  /// Samples per optimizer step (per rank when distributed, as in PyTorch's DDP).
  int64_t batch_size = 64;
  /// SGD learning rate: finite, in (0, 1e4].
  double lr = 0.05;
  /// SGD momentum (PyTorch's formulation: buf = momentum * buf + grad; p -= lr * buf).
  double momentum = 0.9;
  /// How the learning rate changes over the run: "constant", or "cosine" (PyTorch's
  /// CosineAnnealingLR with T_max = every optimizer step of the run and eta_min 0, stepped after
  /// each optimizer step: step t trains at lr * (1 + cos(pi * t / T_max)) / 2). Applies to every
  /// parameter group of any optimizer, and under the parameter server to the servers' optimizer
  /// (each push carries its step's factor).
  std::string lr_schedule = "constant";
  /// Seeds the model's initial weights and the per-epoch shuffle; same seed, same run.
  uint64_t seed = 0;
  /// LibTorch intra-op threads (torch::set_num_threads); 0 leaves the current setting.
  int threads = 2;
  /// Directory with the Fashion-MNIST *-ubyte.gz files, or CIFAR-10's binary files.
  std::string data_dir = "/usr/share/datasets/fashion-mnist";
  /// When not empty, JSON lines are written here: one object per log interval and per epoch.
  std::string metrics_path;
  /// When not empty, a Chrome trace (chrome://tracing, Perfetto) of every rank's forward, backward,
  /// optimizer step and DDP bucket reduction is written here when fit() ends.
  std::string trace_path;
  /// Optimizer steps between progress lines and "step" metrics; 0 turns them off.
  int64_t log_interval = 100;
  /// How progress is shown.
  ProgressMode progress = ProgressMode::kAuto;
  /// Batch size for evaluation; does not change results. 0 (the default): the training batch
  /// size, so that evaluation never holds more than a training step did (a batch of 500 CNN
  /// activations held ~1.5x the training step's peak resident memory; see docs/PERFORMANCE.md).
  int64_t eval_batch_size = 0;
  /// Use only the first N training samples (0 = all): quick runs and tests.
  int64_t train_limit = 0;
  /// Use only the first N test samples (0 = all): quick runs and tests.
  int64_t test_limit = 0;
  /// When not empty, a checkpoint is saved here after every epoch (CheckpointManager layout).
  std::string checkpoint_dir;
  /// Also save a checkpoint every N optimizer steps (0 = only at the end of epochs).
  int64_t checkpoint_every = 0;
  /// Checkpoints kept in checkpoint_dir (older ones are deleted); 0 keeps all.
  int checkpoint_keep = 3;
  /// Continue from the newest checkpoint in checkpoint_dir (an error when there is none).
  bool resume = false;
  /// When not empty, run_training loads the model's initial weights from this state dict file
  /// (torch.save(model.state_dict()) from Python, or one saved by Shoal).
  std::string init_from;
  /// Tests: stop (as if interrupted) once this many optimizer steps were taken in all (0 = never).
  int64_t stop_after_steps = 0;
  /// Tests: when not empty, every rank saves its final weights to "<path>.rank<R>.pt".
  std::string dump_parameters;
  /// Preemption (SLURM's --signal=USR1@90): asked after every optimizer step; when it returns true
  /// on any rank (the ranks agree through one small all-reduce per step, so that all stop at the
  /// same step), the trainer saves a checkpoint in checkpoint_dir and returns with
  /// TrainResult::preempted. Empty: never asked, no extra all-reduce.
  std::function<bool()> stop_requested;

  // --- Data (#29): where the samples come from and how they are loaded ahead of the step.
  /// When not empty, run_training reads the dataset from this torch.save file of a dict with the
  /// tensors train_x, train_y, test_x, test_y (data/tensor_file.h) instead of data_dir.
  std::string data_path;
  /// Threads loading batches ahead of the step (PyTorch's DataLoader num_workers); 0 loads each
  /// batch in the training thread when the step needs it.
  int num_workers = 0;
  /// Batches each worker loads ahead (PyTorch's prefetch_factor).
  int prefetch_factor = 2;

  /// Throws shoal::InvalidArgument naming the first option that cannot work.
  void validate() const;
};

/// Whether `schedule` is a learning-rate schedule the trainer knows ("constant", "cosine").
bool known_lr_schedule(const std::string& schedule);

/// The factor lr_schedule gives the learning rate of optimizer step `step` (0-based) of a run of
/// `total_steps`: 1 for "constant"; (1 + cos(pi * step / total_steps)) / 2 for "cosine" (0 from
/// step total_steps on, as CosineAnnealingLR's closed form at T_max).
double lr_schedule_factor(const std::string& schedule, int64_t step, int64_t total_steps);

}  // namespace shoal::train
