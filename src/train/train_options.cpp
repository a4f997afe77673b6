#include "shoal/train/train_options.h"

#include <cmath>

#include "shoal/error.h"

namespace shoal::train {
namespace {
// Larger learning rates only ever diverge; the bound catches "1e400"-style typos early.
constexpr double kMaxLearningRate = 1e4;
}  // namespace

void TrainOptions::validate() const {
  SHOAL_CHECK_T(InvalidArgument, !model.empty(), "no model given; pass a model name such as cnn");
  SHOAL_CHECK_T(InvalidArgument, epochs >= 1, "epochs must be at least 1, got ", epochs);
  SHOAL_CHECK_T(InvalidArgument, batch_size >= 1, "batch size must be at least 1, got ",
                batch_size);
  SHOAL_CHECK_T(InvalidArgument, std::isfinite(lr) && lr > 0 && lr <= kMaxLearningRate,
                "learning rate must be a finite number in (0, ", kMaxLearningRate, "], got ", lr);
  SHOAL_CHECK_T(InvalidArgument, momentum >= 0 && momentum < 1,
                "momentum must be in [0, 1), got ", momentum);
  SHOAL_CHECK_T(InvalidArgument, known_lr_schedule(lr_schedule),
                "learning-rate schedule must be constant or cosine, got '", lr_schedule, "'");
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
  SHOAL_CHECK_T(InvalidArgument, checkpoint_keep >= 0,
                "checkpoints to keep must be >= 0 (0 = all), got ", checkpoint_keep);
  SHOAL_CHECK_T(InvalidArgument, !resume || !checkpoint_dir.empty(),
                "--resume needs --checkpoint-dir DIR: the folder to resume from");
  SHOAL_CHECK_T(InvalidArgument, checkpoint_every == 0 || !checkpoint_dir.empty(),
                "--checkpoint-every needs --checkpoint-dir DIR: where to save");
  SHOAL_CHECK_T(InvalidArgument, init_from.empty() || !resume,
                "--init-from and --resume both set the weights; pass one of them");
  SHOAL_CHECK_T(InvalidArgument, stop_after_steps >= 0, "stop-after-steps must be >= 0, got ",
                stop_after_steps);
  // Data (#29).
  SHOAL_CHECK_T(InvalidArgument, num_workers >= 0 && num_workers <= 256,
                "num_workers must be in [0, 256], got ", num_workers);
  SHOAL_CHECK_T(InvalidArgument, prefetch_factor >= 1 && prefetch_factor <= 1024,
                "prefetch_factor must be in [1, 1024], got ", prefetch_factor);
}

bool known_lr_schedule(const std::string& schedule) {
  return schedule == "constant" || schedule == "cosine";
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
