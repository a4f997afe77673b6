#include "shoal/train/ddp_strategy.h"

#include <cmath>
#include <iterator>
#include <sstream>

#include "shoal/error.h"
#include "shoal/models/model.h"
#include "shoal/parallel/distributed_data_parallel.h"
#include "shoal/train/trainer.h"
#include "train/around_forward.h"

namespace shoal::train {

DdpStrategy::DdpStrategy(const comm::InitOptions& init)
    : DdpStrategy(comm::init_process_group(init)) {}

DdpStrategy::DdpStrategy(std::shared_ptr<comm::ProcessGroup> group) : group_(std::move(group)) {
  SHOAL_CHECK_T(InvalidArgument, group_ != nullptr, "DdpStrategy: no process group given");
}

DdpStrategy::~DdpStrategy() = default;

namespace {
constexpr const char* kCommHookNames[] = {"allreduce", "fp16", "bf16", "powersgd"};
}  // namespace

CommHookKind parse_comm_hook(const std::string& name) {
  for (size_t i = 0; i < std::size(kCommHookNames); ++i) {
    if (name == kCommHookNames[i]) return static_cast<CommHookKind>(i);
  }
  SHOAL_THROW(InvalidArgument, "unknown communication hook '", name,
              "': use allreduce, fp16, bf16 or powersgd");
}

const char* comm_hook_name(CommHookKind kind) { return kCommHookNames[static_cast<size_t>(kind)]; }

std::vector<std::string> comm_hook_names() {
  return {std::begin(kCommHookNames), std::end(kCommHookNames)};
}

parallel::CommHook make_comm_hook(CommHookKind kind, std::shared_ptr<comm::ProcessGroup> group,
                                  std::shared_ptr<parallel::PowerSGDState> power_sgd) {
  switch (kind) {
    case CommHookKind::kAllreduce:
      return nullptr;
    case CommHookKind::kFp16:
      return parallel::fp16_compress_hook(std::move(group));
    case CommHookKind::kBf16:
      return parallel::bf16_compress_hook(std::move(group));
    case CommHookKind::kPowerSgd:
      if (!power_sgd) power_sgd = std::make_shared<parallel::PowerSGDState>();
      return parallel::powerSGD_hook(std::move(group), std::move(power_sgd));
  }
  return nullptr;
}

void DdpStrategy::set_comm_hook(const std::string& name,
                                std::shared_ptr<parallel::PowerSGDState> power_sgd) {
  set_comm_hook(parse_comm_hook(name), std::move(power_sgd));
}

void DdpStrategy::set_comm_hook(CommHookKind kind,
                                std::shared_ptr<parallel::PowerSGDState> power_sgd) {
  const bool powersgd = kind == CommHookKind::kPowerSgd;
  if (powersgd && !power_sgd) power_sgd = std::make_shared<parallel::PowerSGDState>();
  SHOAL_CHECK_T(InvalidArgument, !power_sgd || power_sgd->matrix_approximation_rank >= 1,
                "PowerSGD's matrix approximation rank must be at least 1, got ",
                power_sgd ? power_sgd->matrix_approximation_rank : 0);
  comm_hook_ = kind;
  power_sgd_ = powersgd ? std::move(power_sgd) : nullptr;
}

void DdpStrategy::set_bucket_cap_mb(double cap_mb) {
  SHOAL_CHECK_T(InvalidArgument,
                (cap_mb > 0 && std::isfinite(cap_mb)) ||
                    cap_mb == parallel::DistributedDataParallelOptions::kBucketCapAuto,
                "DDP's bucket_cap_mb must be a positive number of MiB or auto, got ", cap_mb);
  bucket_cap_mb_ = cap_mb;
}

std::string DdpStrategy::describe() const {
  // How the buckets are reduced beside backward (bucket_reduction auto; a GPU job's group is
  // NCCL's, and its gradients are not computed on the cores).
  // A registered hook (--comm-hook) runs as it is written.
  const parallel::DistributedDataParallelOptions defaults;
  const std::string reduction =
      comm_hook_ != CommHookKind::kAllreduce
          ? ", buckets reduced by the " + std::string(comm_hook_name(comm_hook_)) + " comm hook"
      : group_ && parallel::reduces_buckets_inline(defaults, *group_,
                                                   group_->backend_name() != "nccl")
          ? ", buckets reduced inline (no core spare beside the ranks)"
          : ", buckets reduced overlapped with backward";
  if (bucket_cap_mb_ != parallel::DistributedDataParallelOptions::kBucketCapAuto) {
    std::ostringstream text;
    text << "bucket_cap_mb " << bucket_cap_mb_ << reduction;
    return text.str();
  }
  std::ostringstream text;
  text << "bucket_cap_mb auto (each of";
  for (double cap : defaults.bucket_cap_candidates_mb) text << " " << cap;
  text << " MiB that gives other buckets, tried " << defaults.bucket_cap_tuning_rounds
       << " times over " << defaults.bucket_cap_tuning_steps + 1
       << " steps after the first; the choice is logged and in --metrics)" << reduction;
  return text.str();
}

void DdpStrategy::prepare(TrainState& state) {
  // Any module: the type-independent DDP, around the model's own forward.
  parallel::DistributedDataParallelOptions options;
  options.bucket_cap_mb = bucket_cap_mb_;
  auto ddp = std::make_shared<parallel::DistributedDataParallelBase>(state.model, group_, options);
  stats_source_ = ddp;
  if (auto hook = make_comm_hook(comm_hook_, group_, power_sgd_)) ddp->register_comm_hook(hook);
  // Gradient accumulation: the trainer's first N-1 micro-batches run in no_sync.
  state.no_sync = [ddp] { return std::make_shared<parallel::NoSyncGuard>(ddp->no_sync()); };
  state.forward = around_forward(ddp, state.model_forward);
  state.forward_loss = around_forward(ddp, state.model_loss);
}

at::Tensor DdpStrategy::epoch_indices(int64_t dataset_size, int64_t epoch, uint64_t seed,
                                      int64_t consumed) {
  return sampler_indices(dataset_size, epoch, seed, rank(), world_size(), exactly_once(),
                         consumed);
}

void DdpStrategy::all_reduce_sum(std::vector<double>& values) {
  train::all_reduce_sum(*group_, values);
}

std::optional<CommStats> DdpStrategy::comm_stats() const {
  if (!stats_source_) return std::nullopt;
  const parallel::ReducerStats stats = stats_source_->stats();
  return CommStats{stats.reduced_bytes, stats.wait_seconds, stats.bucket_cap_mb,
                   stats.bucket_cap_tuning};
}

parallel::ReducerStats DdpStrategy::reducer_stats() const {
  return stats_source_ ? stats_source_->stats() : parallel::ReducerStats{};
}

int DdpStrategy::rank() const { return group_->rank(); }
int DdpStrategy::world_size() const { return group_->size(); }

}  // namespace shoal::train
