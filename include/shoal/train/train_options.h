// What the built-in trainer does: the hyper-parameters and the run's plumbing (data, threads,
// metrics, progress), with the defaults of `shoal train`.
//
// Thread safety: a plain value type.
#pragma once

#include <c10/core/Device.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "shoal/data/image_folder.h"
#include "shoal/data/token_file.h"
#include "shoal/models/gpt_config.h"
#include "shoal/train/grad_scaler.h"
#include "shoal/train/loss.h"

namespace shoal::train {

/// How training progress is shown on stderr.
enum class ProgressMode {
  kAuto,   ///< a live bar when stderr is a terminal, else plain lines
  kBar,    ///< a single line redrawn in place: progress, loss, samples/s, ETA
  kLines,  ///< one plain line every log_interval steps (for logs and pipes)
  kNone,   ///< nothing but the per-epoch summaries
};

/// The optimizers the trainer builds (TrainOptions::optimizer names one).
enum class Optimizer {
  kSgd,    ///< "sgd": torch.optim.SGD (lr, momentum, weight_decay)
  kAdam,   ///< "adam": torch.optim.Adam (lr, betas, eps, weight_decay)
  kAdamW,  ///< "adamw": torch.optim.AdamW (decoupled weight decay)
};

/// The optimizer `name` names ("sgd", "adam", "adamw"); InvalidArgument for any other name.
Optimizer parse_optimizer(const std::string& name);
/// The name parse_optimizer reads as `optimizer`.
const char* optimizer_name(Optimizer optimizer);
/// Every optimizer's name, in the enum's order.
std::vector<std::string> optimizer_names();

/// How the learning rate changes over a run (TrainOptions::lr_schedule says how each works).
enum class LrSchedule {
  kConstant,   ///< "constant"
  kCosine,     ///< "cosine": CosineAnnealingLR
  kStep,       ///< "step": StepLR
  kMultiStep,  ///< "multistep": MultiStepLR
};
/// The schedule `name` names; InvalidArgument for any other name.
LrSchedule parse_lr_schedule(const std::string& name);
/// The name parse_lr_schedule reads as `schedule`.
const char* lr_schedule_name(LrSchedule schedule);
/// Every schedule's name, in the enum's order.
std::vector<std::string> lr_schedule_names();

/// The precision of the forward and the loss (TrainOptions::precision).
enum class Precision {
  kFp32,  ///< "fp32"
  kBf16,  ///< "bf16": CPU autocast to bfloat16
  kFp16,  ///< "fp16": autocast to float16 with a loss scaler
};
/// The precision `name` names; InvalidArgument for any other name.
Precision parse_precision(const std::string& name);
/// The name parse_precision reads as `precision`.
const char* precision_name(Precision precision);
/// Every precision's name, in the enum's order.
std::vector<std::string> precision_names();

/// How a checkpoint is written (TrainOptions::checkpoint_format).
enum class CheckpointFormat {
  kFull,     ///< "full": one file, the whole state gathered to rank 0
  kSharded,  ///< "sharded": each rank writes its own piece
};
/// The format `name` names; InvalidArgument for any other name.
CheckpointFormat parse_checkpoint_format(const std::string& name);
/// The name parse_checkpoint_format reads as `format`.
const char* checkpoint_format_name(CheckpointFormat format);
/// Every format's name, in the enum's order.
std::vector<std::string> checkpoint_format_names();

/// Options of a training run. The defaults are those of `shoal train`; they were measured to reach
/// >= 0.85 Fashion-MNIST test accuracy with the CNN in one epoch on two CPU cores.
struct TrainOptions {
  /// A name known to shoal::models::create ("cnn", "mlp"), or a TorchScript file's path
  /// (models::is_script_path).
  std::string model = "cnn";
  /// The loss minimized on the model's output (`--loss`); a model that computes its own loss
  /// (models::Model::owns_loss) ignores it.
  Loss loss = Loss::kCrossEntropy;
  /// The sizes of --model gpt (--n-layer, --n-head, ...).
  models::GptConfig gpt;
  /// Passes over the training set.
  int64_t epochs = 1;
  /// Samples per optimizer step (per rank when distributed, as in PyTorch's DDP).
  int64_t batch_size = 64;
  /// SGD learning rate: finite, in (0, 1e4].
  double lr = 0.05;
  /// SGD momentum (PyTorch's formulation: buf = momentum * buf + grad; p -= lr * buf).
  double momentum = 0.9;
  /// How the learning rate changes over the run, as PyTorch's schedulers stepped after each
  /// optimizer step: "constant"; "cosine" (CosineAnnealingLR, eta_min 0, T_max = t_max or every
  /// optimizer step of the run after the warm-up: step t trains at lr * (1 + cos(pi * t / T_max))
  /// / 2); "step" (StepLR: lr * gamma^(t / step_size)); "multistep" (MultiStepLR: lr * gamma^(the
  /// milestones <= t)). With warmup_steps, SequentialLR([LinearLR(start_factor=
  /// warmup_start_factor, total_iters=warmup_steps), that schedule], milestones=[warmup_steps]):
  /// the schedule starts counting after the warm-up. Applies to every parameter group of any
  /// optimizer, and under the parameter server to the servers' optimizer (each push carries its
  /// step's factor).
  LrSchedule lr_schedule = LrSchedule::kConstant;
  /// Seeds the model's initial weights, the per-epoch shuffle and (in run_training) torch's default
  /// CPU generator, which dropout draws from; same seed, same run.
  uint64_t seed = 0;
  /// Compute threads: LibTorch's intra-op threads (torch::set_num_threads) and OpenBLAS's, the
  /// same count whatever OMP_NUM_THREADS the process was started with; 0 leaves both as they are.
  int threads = 2;
  /// Directory with the Fashion-MNIST *-ubyte.gz files, CIFAR-10's binary files, or a folder of
  /// images (data::open_image_folders: DIR/train with DIR/val or DIR/test, or DIR alone).
  std::string data_dir = "/usr/share/datasets/fashion-mnist";
  /// The transforms of a folder of images in data_dir (its seed is replaced by `seed`); the
  /// evaluation split gets their evaluation() part.
  data::ImageFolderOptions image_folder;
  /// Refuse data files that decode to more than this multiple of their size (beyond 64 MiB);
  /// 0 turns the check off. See data::FashionMnist::kMaxDecompressionRatio.
  double max_decompression_ratio = 64.0;
  /// When not empty, JSON lines are written here: one object per log interval and per epoch.
  std::string metrics_path;
  /// When not empty, a Chrome trace (chrome://tracing, Perfetto) of every rank's forward, backward,
  /// optimizer step and DDP bucket reduction is written here when fit() ends.
  std::string trace_path;
  /// When not empty, TensorBoard event files are written into this run folder (rank 0's; with
  /// tensorboard_all_ranks every rank's into DIR/rank<R>): the values of every "step" and
  /// "epoch" metrics line as scalars (train/..., epoch/...), the run's configuration as text, and
  /// parameter histograms every histogram_interval steps.
  std::string tensorboard_dir;
  /// Every rank writes TensorBoard files (into tensorboard_dir/rank<R>), not rank 0 alone.
  bool tensorboard_all_ranks = false;
  /// Optimizer steps between parameter histograms in TensorBoard (0 = none). 100, as
  /// log_interval: an epoch of the default run (938 steps; 469 per rank of `make run`'s two)
  /// writes several.
  int64_t histogram_interval = 100;
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
  /// kFull (one file, the whole state gathered to rank 0) or kSharded (each rank writes its
  /// own piece; --strategy fsdp only; see checkpoint/sharded_checkpoint.h).
  CheckpointFormat checkpoint_format = CheckpointFormat::kFull;
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

  // ---- Optimizer, schedule, clipping, accumulation and precision ----------------------------
  /// The optimizer the trainer builds: "sgd" (lr, momentum, weight_decay), "adam" or "adamw"
  /// (torch.optim.Adam / AdamW: lr, betas, eps, weight_decay; AdamW decays the weights by
  /// lr x weight_decay apart from the gradient).
  Optimizer optimizer = Optimizer::kSgd;
  /// Adam/AdamW's betas, each in [0, 1).
  double beta1 = 0.9;
  double beta2 = 0.999;
  /// Adam/AdamW's eps, > 0.
  double eps = 1e-8;
  /// Weight decay, >= 0; unset: the optimizer's PyTorch default (0 for SGD and Adam, 1e-2 for
  /// AdamW).
  std::optional<double> weight_decay;
  /// Optimizer steps of linear warm-up (LinearLR's total_iters) before lr_schedule; 0: none.
  int64_t warmup_steps = 0;
  /// LinearLR's start_factor: the warm-up's first step trains at lr x this, in (0, 1].
  double warmup_start_factor = 1.0 / 3;
  /// StepLR's step_size (lr_schedule "step"), >= 1.
  int64_t step_size = 0;
  /// StepLR's and MultiStepLR's gamma, in (0, 1].
  double gamma = 0.1;
  /// MultiStepLR's milestones (lr_schedule "multistep"): increasing optimizer steps.
  std::vector<int64_t> milestones;
  /// CosineAnnealingLR's T_max; 0: every optimizer step of the run after the warm-up.
  int64_t t_max = 0;
  /// torch.nn.utils.clip_grad_norm_'s max_norm over the global L2 norm of all gradients (after
  /// DDP's averaging; across all stages of a pipeline); 0: no clipping.
  double clip_grad_norm = 0;
  /// Micro-batches of batch_size per optimizer step (gradient accumulation; under DDP the first
  /// N-1 backward passes run in no_sync); 1: none.
  int64_t accumulate = 1;
  /// "fp32", or "bf16": the forward and the loss under CPU autocast to bfloat16 (torch.autocast(
  /// "cpu", dtype=torch.bfloat16)); the weights, gradients and optimizer stay float32. "fp16":
  /// autocast to float16 with a gradient scaler (torch.amp.GradScaler; needs LibTorch >= 2.4 on
  /// the CPU, see compat::cpu_autocast_supports).
  Precision precision = Precision::kFp32;
  /// The loss scaler's options (torch.amp.GradScaler's). Set: the trainer scales the loss with
  /// them at any precision (a float32 model too); unset: the defaults under "fp16", none else.
  std::optional<GradScalerOptions> grad_scaler;
  /// Where the model trains: "cpu", or "cuda" / "cuda:N": the parameters, the optimizer's
  /// state, each batch and the forward's autocast on that GPU ("cuda": GPU local rank modulo the
  /// GPUs visible, the local rank as comm::detect_rank_info finds it, so one rank per GPU under
  /// any launcher). The trainer's single and ddp strategies
  /// (ddp's collectives on CUDA tensors: nccl, or gloo/shm through host memory). Checkpoints hold
  /// CPU tensors either way, and resume on either device.
  std::string device = "cpu";

  // --- Data: where the samples come from and how they are loaded ahead of the step.
  /// When not empty, run_training reads the dataset from this torch.save file of a dict with the
  /// tensors train_x, train_y, test_x, test_y (data/tensor_file.h) instead of data_dir.
  std::string data_path;
  /// --model gpt on a token stream: data_path ending in ".bin" is a flat file of token ids
  /// (nanoGPT's train.bin, `shoal data tokenize`'s output), cut into blocks of gpt.block_size + 1
  /// tokens, each trained on once per epoch (data/token_block_dataset.h); this is the validation
  /// stream (val.bin) evaluated after each epoch, empty for none.
  std::string val_data_path;
  /// The width of the token files' ids: kUInt16 (nanoGPT's, vocabularies up to 65,536) or
  /// kUInt32.
  data::TokenDtype token_dtype = data::TokenDtype::kUInt16;
  /// Threads loading batches ahead of the step (PyTorch's DataLoader num_workers); 0 loads each
  /// batch in the training thread when the step needs it.
  int num_workers = 0;
  /// Batches each worker loads ahead (PyTorch's prefetch_factor).
  int prefetch_factor = 2;

  /// Throws shoal::InvalidArgument naming the first option that cannot work: the checks of
  /// train_option_table()'s rows, in order.
  void validate() const;
};

/// Whether `path` names a token file (".bin"): TrainOptions::data_path's token-stream form.
bool is_token_file(const std::string& path);

/// Whether `name` is a device name TrainOptions::device takes ("cpu", "cuda", "cuda:N"), whether
/// or not this machine has it (resolve_device says).
bool is_device_name(const std::string& name);

/// The device `name` ("cpu", "cuda", "cuda:N"; TrainOptions::device) means in this process:
/// "cuda" is GPU local rank (comm::detect_rank_info: torchrun, SLURM, OpenMPI; 0 alone) modulo
/// the GPUs visible. Throws InvalidArgument when
/// the name is none of those, or names CUDA where this LibTorch has no CUDA or sees no GPU.
at::Device resolve_device(const std::string& name);

/// The factor `schedule` gives the learning rate of optimizer step `step` (0-based) of a run of
/// `total_steps`: 1 for kConstant; (1 + cos(pi * step / total_steps)) / 2 for kCosine (0 from
/// step total_steps on, as CosineAnnealingLR's closed form at T_max). The other schedules need
/// their options (the overload below): InvalidArgument.
double lr_schedule_factor(LrSchedule schedule, int64_t step, int64_t total_steps);

/// The factor options' schedule (warm-up and lr_schedule, see TrainOptions::lr_schedule) gives
/// the learning rate of optimizer step `step` (0-based) of a run of `total_steps`: what PyTorch's
/// schedulers, stepped after each optimizer step, have made of the base lr by then.
double lr_schedule_factor(const TrainOptions& options, int64_t step, int64_t total_steps);

}  // namespace shoal::train
