#include "shoal/train/train_options.h"

#include <algorithm>
#include <cmath>
#include <iterator>

#include "shoal/comm/init.h"
#include "shoal/error.h"
#include "shoal/train/train_option_table.h"
#include "train/choice_names.h"

#include <torch/cuda.h>
#include <torch/version.h>

#include <optional>

namespace shoal::train {
namespace {

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

bool is_device_name(const std::string& name) {
  return name == "cpu" || cuda_index(name).has_value();
}

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

void TrainOptions::validate() const { check_train_options(*this, OptionRows::kAll); }

namespace {
// Each in its enum's order.
constexpr const char* kOptimizerNames[] = {"sgd", "adam", "adamw"};
constexpr const char* kLrScheduleNames[] = {"constant", "cosine", "step", "multistep"};
constexpr const char* kPrecisionNames[] = {"fp32", "bf16", "fp16"};
constexpr const char* kCheckpointFormatNames[] = {"full", "sharded"};
}  // namespace

Optimizer parse_optimizer(const std::string& name) {
  return detail::parse_choice<Optimizer>(kOptimizerNames, name, "optimizer");
}
const char* optimizer_name(Optimizer optimizer) {
  return detail::choice_name(kOptimizerNames, optimizer);
}
std::vector<std::string> optimizer_names() { return detail::choice_names(kOptimizerNames); }

LrSchedule parse_lr_schedule(const std::string& name) {
  return detail::parse_choice<LrSchedule>(kLrScheduleNames, name, "learning-rate schedule");
}
const char* lr_schedule_name(LrSchedule schedule) {
  return detail::choice_name(kLrScheduleNames, schedule);
}
std::vector<std::string> lr_schedule_names() { return detail::choice_names(kLrScheduleNames); }

Precision parse_precision(const std::string& name) {
  return detail::parse_choice<Precision>(kPrecisionNames, name, "precision");
}
const char* precision_name(Precision precision) {
  return detail::choice_name(kPrecisionNames, precision);
}
std::vector<std::string> precision_names() { return detail::choice_names(kPrecisionNames); }

CheckpointFormat parse_checkpoint_format(const std::string& name) {
  return detail::parse_choice<CheckpointFormat>(kCheckpointFormatNames, name, "--checkpoint-format");
}
const char* checkpoint_format_name(CheckpointFormat format) {
  return detail::choice_name(kCheckpointFormatNames, format);
}
std::vector<std::string> checkpoint_format_names() {
  return detail::choice_names(kCheckpointFormatNames);
}

bool is_token_file(const std::string& path) {
  const std::string suffix = ".bin";
  return path.size() > suffix.size() &&
         path.compare(path.size() - suffix.size(), suffix.size(), suffix) == 0;
}

double lr_schedule_factor(LrSchedule schedule, int64_t step, int64_t total_steps) {
  if (schedule == LrSchedule::kConstant) return 1;
  SHOAL_CHECK_T(InvalidArgument, schedule == LrSchedule::kCosine, "learning-rate schedule '",
                lr_schedule_name(schedule), "' needs its options (constant or cosine alone)");
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
  const LrSchedule schedule = options.lr_schedule;
  if (schedule == LrSchedule::kStep) {
    return std::pow(options.gamma, static_cast<double>(t / options.step_size));
  }
  if (schedule == LrSchedule::kMultiStep) {
    // MultiStepLR: gamma to the number of milestones reached (bisect_right).
    const auto reached = std::upper_bound(options.milestones.begin(), options.milestones.end(), t) -
                         options.milestones.begin();
    return std::pow(options.gamma, static_cast<double>(reached));
  }
  if (schedule == LrSchedule::kCosine) {
    if (options.t_max == 0) return lr_schedule_factor(schedule, t, total_steps - warmup);
    // Past T_max PyTorch's recursion follows the same cosine back up (period 2 T_max).
    const double pi = std::acos(-1.0);
    return (1 + std::cos(pi * static_cast<double>(t) / static_cast<double>(options.t_max))) / 2;
  }
  return lr_schedule_factor(schedule, t, total_steps - warmup);
}

}  // namespace shoal::train
