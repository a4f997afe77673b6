#include "shoal/train/fsdp_strategy.h"

#include <torch/optim/optimizer.h>

#include "shoal/error.h"
#include "shoal/parallel/fully_sharded_data_parallel.h"
#include "shoal/train/trainer.h"

namespace shoal::train {

FsdpStrategy::FsdpStrategy(int stage, const comm::InitOptions& init)
    : FsdpStrategy(stage, comm::init_process_group(init)) {}

FsdpStrategy::FsdpStrategy(int stage, std::shared_ptr<comm::ProcessGroup> group)
    : stage_(stage), group_(std::move(group)) {
  parallel::sharding_strategy_from_stage(stage_);  // refuses anything but 1, 2, 3
  SHOAL_CHECK_T(InvalidArgument, group_ != nullptr, "FsdpStrategy: no process group given");
}

FsdpStrategy::~FsdpStrategy() = default;

void FsdpStrategy::prepare(TrainState& state) {
  parallel::FullyShardedDataParallelOptions options;
  options.sharding_strategy = parallel::sharding_strategy_from_stage(stage_);
  // Every submodule that holds parameters of its own is a unit (the built-in models' layers):
  // the policy with a threshold of one parameter wraps each leaf with parameters.
  options.auto_wrap_min_num_params = 1;
  auto fsdp = std::make_shared<parallel::FullyShardedDataParallel>(state.model, group_, options);
  fsdp_ = fsdp;
  // The trainer's optimizer is over the whole model (and holds a checkpoint's state after a
  // resume): the one that steps is over the shards, each rank taking its piece of that state.
  SHOAL_CHECK_T(InvalidArgument, state.optimizer != nullptr, "--strategy fsdp: no optimizer");
  auto sharded = parallel::optimizer_like(*state.optimizer, fsdp->parameters());
  fsdp->load_full_optimizer(*state.optimizer, *sharded);
  state.optimizer = std::move(sharded);
  state.forward = [fsdp, forward = state.model_forward](const at::Tensor& input) {
    fsdp->prepare_for_forward();
    at::Tensor output = forward(input);
    fsdp->prepare_for_backward(output);
    return output;
  };
}

torch::optim::Optimizer* FsdpStrategy::checkpoint_optimizer(TrainState& state) {
  if (!fsdp_) return state.optimizer.get();
  full_optimizer_ = fsdp_->full_optimizer(*state.optimizer);
  return full_optimizer_.get();
}

void FsdpStrategy::synchronize(TrainState&) {
  if (fsdp_) fsdp_->gather_full_parameters();
}

at::Tensor FsdpStrategy::epoch_indices(int64_t dataset_size, int64_t epoch, uint64_t seed) {
  return sampler_indices(dataset_size, epoch, seed, rank(), world_size());
}

void FsdpStrategy::all_reduce_sum(std::vector<double>& values) {
  train::all_reduce_sum(*group_, values);
}

int FsdpStrategy::rank() const { return group_->rank(); }
int FsdpStrategy::world_size() const { return group_->size(); }

}  // namespace shoal::train
