#include "shoal/train/train_options.h"

#include <algorithm>
#include <cmath>

#include "compat/autocast.h"
#include "shoal/comm/init.h"
#include "shoal/error.h"

#include <torch/cuda.h>
#include <torch/version.h>

#include <optional>

namespace shoal::train {
namespace {
// Larger learning rates only ever diverge; the bound catches "1e400"-style typos early.
constexpr double kMaxLearningRate = 1e4;

// ---- Optimizer, schedule, clipping, accumulation and precision (#29) ----------------------------

void validate_training_features(const TrainOptions& o) {
  SHOAL_CHECK_T(InvalidArgument, o.optimizer == "sgd" || o.optimizer == "adam" || o.optimizer == "adamw",
                "optimizer must be sgd, adam or adamw, got '", o.optimizer, "'");
  SHOAL_CHECK_T(InvalidArgument, o.beta1 >= 0 && o.beta1 < 1 && o.beta2 >= 0 && o.beta2 < 1,
                "betas must be two numbers in [0, 1), got ", o.beta1, ",", o.beta2);
  SHOAL_CHECK_T(InvalidArgument, std::isfinite(o.eps) && o.eps > 0, "eps must be > 0, got ", o.eps);
  SHOAL_CHECK_T(InvalidArgument,
                !o.weight_decay || (std::isfinite(*o.weight_decay) && *o.weight_decay >= 0),
                "weight decay must be a finite number >= 0, got ", o.weight_decay.value_or(0));
  SHOAL_CHECK_T(InvalidArgument, o.warmup_steps >= 0, "warm-up steps must be >= 0, got ",
                o.warmup_steps);
  SHOAL_CHECK_T(InvalidArgument, o.warmup_start_factor > 0 && o.warmup_start_factor <= 1,
                "warm-up start factor must be in (0, 1] (LinearLR's start_factor), got ",
                o.warmup_start_factor);
  SHOAL_CHECK_T(InvalidArgument, o.lr_schedule != "step" || o.step_size >= 1,
                "--lr-schedule step needs --step-size N (N >= 1 optimizer steps), got ", o.step_size);
  SHOAL_CHECK_T(InvalidArgument, o.gamma > 0 && o.gamma <= 1, "gamma must be in (0, 1], got ",
                o.gamma);
  SHOAL_CHECK_T(InvalidArgument, o.lr_schedule != "multistep" || !o.milestones.empty(),
                "--lr-schedule multistep needs --milestones A,B,... (optimizer steps)");
  for (size_t i = 0; i < o.milestones.size(); ++i) {
    SHOAL_CHECK_T(InvalidArgument, o.milestones[i] >= 1 && (i == 0 || o.milestones[i] > o.milestones[i - 1]),
                  "milestones must be increasing optimizer steps >= 1, got ", o.milestones[i],
                  " at position ", i + 1);
  }
  SHOAL_CHECK_T(InvalidArgument, o.t_max >= 0, "T_max must be >= 0 (0 = the rest of the run), got ",
                o.t_max);
  SHOAL_CHECK_T(InvalidArgument, std::isfinite(o.clip_grad_norm) && o.clip_grad_norm >= 0,
                "the gradient clipping norm must be a finite number >= 0 (0 = none), got ",
                o.clip_grad_norm);
  SHOAL_CHECK_T(InvalidArgument, o.accumulate >= 1 && o.accumulate <= 65536,
                "accumulate must be in [1, 65536] micro-batches per step, got ", o.accumulate);
  SHOAL_CHECK_T(InvalidArgument, o.precision == "fp32" || o.precision == "bf16" || o.precision == "fp16",
                "precision must be fp32, bf16 or fp16, got '", o.precision, "'");
  SHOAL_CHECK_T(InvalidArgument,
                o.precision != "fp16" || o.device != "cpu" || compat::cpu_autocast_supports(at::kHalf),
                "--precision fp16 needs --device cuda, or LibTorch >= 2.4 on the CPU (this is "
                "LibTorch ", TORCH_VERSION, ", whose CPU autocast has no float16): use --precision "
                "bf16 on the CPU");
}

/// "cuda:N"'s N, or -1 for "cuda"; nullopt when `name` is neither "cpu" nor a CUDA device name.
std::optional<int> cuda_index(const std::string& name) {
  if (name == "cuda") return -1;
  if (name.rfind("cuda:", 0) != 0 || name.size() == 5 || name.size() > 8) return std::nullopt;
  for (size_t i = 5; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return std::nullopt;
  }
  return std::stoi(name.substr(5));
}

}  // namespace

at::Device resolve_device(const std::string& name) {
  if (name == "cpu") return at::kCPU;
  const std::optional<int> index = cuda_index(name);
  SHOAL_CHECK_T(InvalidArgument, index.has_value(), "--device must be cpu, cuda or cuda:N, got '",
                name, "'");
  SHOAL_CHECK_T(InvalidArgument, torch::cuda::is_available(), "--device ", name,
                ": no CUDA GPU here (this LibTorch ", TORCH_VERSION,
                " has no CUDA or sees no GPU); train with --device cpu");
  const int count = static_cast<int>(torch::cuda::device_count());
  // "cuda": this rank's local rank, however the job was started (torchrun, srun, mpirun, shoal).
  const int chosen = *index >= 0 ? *index : comm::detect_rank_info().local_rank % count;
  SHOAL_CHECK_T(InvalidArgument, chosen < count, "--device ", name, ": this machine has ", count,
                " GPU(s), cuda:0 to cuda:", count - 1);
  return at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(chosen));
}

void TrainOptions::validate() const {
  SHOAL_CHECK_T(InvalidArgument, device == "cpu" || cuda_index(device).has_value(),
                "--device must be cpu, cuda or cuda:N, got '", device, "'");
  SHOAL_CHECK_T(InvalidArgument, !model.empty(), "no model given; pass a model name such as cnn");
  if (model == "gpt") gpt.validate();
  SHOAL_CHECK_T(InvalidArgument, epochs >= 1, "epochs must be at least 1, got ", epochs);
  SHOAL_CHECK_T(InvalidArgument, batch_size >= 1, "batch size must be at least 1, got ",
                batch_size);
  SHOAL_CHECK_T(InvalidArgument, std::isfinite(lr) && lr > 0 && lr <= kMaxLearningRate,
                "learning rate must be a finite number in (0, ", kMaxLearningRate, "], got ", lr);
  SHOAL_CHECK_T(InvalidArgument, momentum >= 0 && momentum < 1,
                "momentum must be in [0, 1), got ", momentum);
  SHOAL_CHECK_T(InvalidArgument, known_lr_schedule(lr_schedule),
                "learning-rate schedule must be constant, cosine, step or multistep, got '",
                lr_schedule, "'");
  SHOAL_CHECK_T(InvalidArgument, threads >= 0, "threads must be >= 0 (0 = LibTorch's default), got ",
                threads);
  SHOAL_CHECK_T(InvalidArgument, log_interval >= 0,
                "log interval must be >= 0 (0 = no step logs), got ", log_interval);
  SHOAL_CHECK_T(InvalidArgument, eval_batch_size >= 0,
                "evaluation batch size must be >= 0 (0 = the training batch size), got ",
                eval_batch_size);
  SHOAL_CHECK_T(InvalidArgument, train_limit >= 0, "train limit must be >= 0 (0 = all), got ",
                train_limit);
  SHOAL_CHECK_T(InvalidArgument, test_limit >= 0, "test limit must be >= 0 (0 = all), got ",
                test_limit);
  SHOAL_CHECK_T(InvalidArgument, checkpoint_every >= 0,
                "checkpoint interval must be >= 0 (0 = only after epochs), got ", checkpoint_every);
  SHOAL_CHECK_T(InvalidArgument, checkpoint_format == "full" || checkpoint_format == "sharded",
                "--checkpoint-format must be full or sharded, got '", checkpoint_format, "'");
  SHOAL_CHECK_T(InvalidArgument, checkpoint_keep >= 0,
                "checkpoints to keep must be >= 0 (0 = all), got ", checkpoint_keep);
  SHOAL_CHECK_T(InvalidArgument, !resume || !checkpoint_dir.empty(),
                "--resume needs --checkpoint-dir DIR: the folder to resume from");
  SHOAL_CHECK_T(InvalidArgument, checkpoint_every == 0 || !checkpoint_dir.empty(),
                "--checkpoint-every needs --checkpoint-dir DIR: where to save");
  SHOAL_CHECK_T(InvalidArgument, token_dtype == "uint16" || token_dtype == "uint32",
                "--token-dtype must be uint16 or uint32, got '", token_dtype, "'");
  SHOAL_CHECK_T(InvalidArgument, val_data_path.empty() || is_token_file(data_path),
                "--val-data ", val_data_path, " needs --data TRAIN.bin, a token file to train on");
  SHOAL_CHECK_T(InvalidArgument, val_data_path.empty() || is_token_file(val_data_path),
                "--val-data ", val_data_path, " must be a token file (.bin), as --data");
  SHOAL_CHECK_T(InvalidArgument, !is_token_file(data_path) || model == "gpt",
                "--data ", data_path, " is a token file (.bin): it trains --model gpt, not --model ",
                model);
  SHOAL_CHECK_T(InvalidArgument, init_from.empty() || !resume,
                "--init-from and --resume both set the weights; pass one of them");
  SHOAL_CHECK_T(InvalidArgument, max_decompression_ratio >= 0,
                "--max-decompression-ratio must be >= 0 (0 = no check), got ", max_decompression_ratio);
  SHOAL_CHECK_T(InvalidArgument, histogram_interval >= 0,
                "histogram interval must be >= 0 (0 = no histograms), got ", histogram_interval);
  SHOAL_CHECK_T(InvalidArgument, !tensorboard_all_ranks || !tensorboard_dir.empty(),
                "--tensorboard-all-ranks needs --tensorboard DIR: where to write");
  SHOAL_CHECK_T(InvalidArgument, stop_after_steps >= 0, "stop-after-steps must be >= 0, got ",
                stop_after_steps);
  validate_training_features(*this);
  // Data (#29).
  SHOAL_CHECK_T(InvalidArgument, num_workers >= 0 && num_workers <= 256,
                "num_workers must be in [0, 256], got ", num_workers);
  SHOAL_CHECK_T(InvalidArgument, prefetch_factor >= 1 && prefetch_factor <= 1024,
                "prefetch_factor must be in [1, 1024], got ", prefetch_factor);
}

bool is_token_file(const std::string& path) {
  const std::string suffix = ".bin";
  return path.size() > suffix.size() &&
         path.compare(path.size() - suffix.size(), suffix.size(), suffix) == 0;
}

bool known_lr_schedule(const std::string& schedule) {
  return schedule == "constant" || schedule == "cosine" || schedule == "step" ||
         schedule == "multistep";
}

double lr_schedule_factor(const std::string& schedule, int64_t step, int64_t total_steps) {
  if (schedule == "constant") return 1;
  SHOAL_CHECK_T(InvalidArgument, schedule == "cosine", "unknown learning-rate schedule '",
                schedule, "' (constant or cosine)");
  if (total_steps <= 0 || step >= total_steps) return 0;
  const double pi = std::acos(-1.0);
  return (1 + std::cos(pi * static_cast<double>(step) / static_cast<double>(total_steps))) / 2;
}

}  // namespace shoal::train

namespace shoal::train {

double lr_schedule_factor(const TrainOptions& options, int64_t step, int64_t total_steps) {
  // SequentialLR: the warm-up (LinearLR) up to its milestone, then the schedule counted from 0.
  const int64_t warmup = options.warmup_steps;
  if (warmup > 0 && step < warmup) {
    const double start = options.warmup_start_factor;
    return start + (1 - start) * static_cast<double>(step) / static_cast<double>(warmup);
  }
  const int64_t t = step - warmup;
  const std::string& schedule = options.lr_schedule;
  if (schedule == "step") {
    return std::pow(options.gamma, static_cast<double>(t / options.step_size));
  }
  if (schedule == "multistep") {
    // MultiStepLR: gamma to the number of milestones reached (bisect_right).
    const auto reached = std::upper_bound(options.milestones.begin(), options.milestones.end(), t) -
                         options.milestones.begin();
    return std::pow(options.gamma, static_cast<double>(reached));
  }
  if (schedule == "cosine") {
    if (options.t_max == 0) return lr_schedule_factor("cosine", t, total_steps - warmup);
    // Past T_max PyTorch's recursion follows the same cosine back up (period 2 T_max).
    const double pi = std::acos(-1.0);
    return (1 + std::cos(pi * static_cast<double>(t) / static_cast<double>(options.t_max))) / 2;
  }
  return lr_schedule_factor(schedule, t, total_steps - warmup);
}

}  // namespace shoal::train
