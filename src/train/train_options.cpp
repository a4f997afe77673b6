#include "shoal/train/train_options.h"

#include <algorithm>
#include <cmath>
#include <iterator>

#include "shoal/comm/init.h"
#include "shoal/error.h"
#include "shoal/train/train_option_table.h"

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

void TrainOptions::validate() const {
  for (const TrainOption& row : train_option_table()) {
    if (row.check) row.check(*this);
  }
}

namespace {
constexpr const char* kOptimizerNames[] = {"sgd", "adam", "adamw"};
}  // namespace

Optimizer parse_optimizer(const std::string& name) {
  for (size_t i = 0; i < std::size(kOptimizerNames); ++i) {
    if (name == kOptimizerNames[i]) return static_cast<Optimizer>(i);
  }
  SHOAL_THROW(InvalidArgument, "optimizer must be sgd, adam or adamw, got '", name, "'");
}

const char* optimizer_name(Optimizer optimizer) {
  return kOptimizerNames[static_cast<size_t>(optimizer)];
}

std::vector<std::string> optimizer_names() {
  return {std::begin(kOptimizerNames), std::end(kOptimizerNames)};
}

bool known_optimizer(const std::string& name) {
  const auto names = optimizer_names();
  return std::find(names.begin(), names.end(), name) != names.end();
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
