#include "shoal/train/ddp_strategy.h"

#include "shoal/error.h"
#include "shoal/models/model.h"
#include "shoal/parallel/distributed_data_parallel.h"
#include "shoal/train/trainer.h"

namespace shoal::train {

DdpStrategy::DdpStrategy(const comm::InitOptions& init)
    : DdpStrategy(comm::init_process_group(init)) {}

DdpStrategy::DdpStrategy(std::shared_ptr<comm::ProcessGroup> group) : group_(std::move(group)) {
  SHOAL_CHECK_T(InvalidArgument, group_ != nullptr, "DdpStrategy: no process group given");
}

DdpStrategy::~DdpStrategy() = default;

void DdpStrategy::set_comm_hook(const std::string& name,
                                std::shared_ptr<parallel::PowerSGDState> power_sgd) {
  SHOAL_CHECK_T(InvalidArgument,
                name == "allreduce" || name == "fp16" || name == "bf16" || name == "powersgd",
                "unknown communication hook '", name, "': use allreduce, fp16, bf16 or powersgd");
  if (name == "powersgd" && !power_sgd) power_sgd = std::make_shared<parallel::PowerSGDState>();
  SHOAL_CHECK_T(InvalidArgument, !power_sgd || power_sgd->matrix_approximation_rank >= 1,
                "PowerSGD's matrix approximation rank must be at least 1, got ",
                power_sgd ? power_sgd->matrix_approximation_rank : 0);
  comm_hook_ = name;
  power_sgd_ = name == "powersgd" ? std::move(power_sgd) : nullptr;
}

void DdpStrategy::prepare(TrainState& state) {
  // Any module: the type-independent DDP, around the model's own forward.
  auto ddp = std::make_shared<parallel::DistributedDataParallelBase>(state.model, group_);
  stats_source_ = ddp;
  if (comm_hook_ == "fp16") ddp->register_comm_hook(parallel::fp16_compress_hook(group_));
  if (comm_hook_ == "bf16") ddp->register_comm_hook(parallel::bf16_compress_hook(group_));
  if (comm_hook_ == "powersgd") ddp->register_comm_hook(parallel::powerSGD_hook(group_, power_sgd_));
  // Gradient accumulation (#29): the trainer's first N-1 micro-batches run in no_sync.
  state.no_sync = [ddp] { return std::make_shared<parallel::NoSyncGuard>(ddp->no_sync()); };
  state.forward = [ddp, forward = state.model_forward](const at::Tensor& input) {
    ddp->prepare_for_forward();
    at::Tensor output = forward(input);
    ddp->prepare_for_backward(output);
    return output;
  };
}

at::Tensor DdpStrategy::epoch_indices(int64_t dataset_size, int64_t epoch, uint64_t seed) {
  return sampler_indices(dataset_size, epoch, seed, rank(), world_size());
}

void DdpStrategy::all_reduce_sum(std::vector<double>& values) {
  train::all_reduce_sum(*group_, values);
}

std::optional<CommStats> DdpStrategy::comm_stats() const {
  if (!stats_source_) return std::nullopt;
  const parallel::ReducerStats stats = stats_source_->stats();
  return CommStats{stats.reduced_bytes, stats.wait_seconds};
}

parallel::ReducerStats DdpStrategy::reducer_stats() const {
  return stats_source_ ? stats_source_->stats() : parallel::ReducerStats{};
}

int DdpStrategy::rank() const { return group_->rank(); }
int DdpStrategy::world_size() const { return group_->size(); }

}  // namespace shoal::train
