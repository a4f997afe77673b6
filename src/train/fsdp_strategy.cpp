#include "shoal/train/fsdp_strategy.h"

#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include "shoal/error.h"
#include "shoal/parallel/fully_sharded_data_parallel.h"
#include "shoal/train/trainer.h"

namespace shoal::train {
namespace {

// An optimizer of the same kind and options as `given` over `params` (SGD and Adam).
std::unique_ptr<torch::optim::Optimizer> same_optimizer(const torch::optim::Optimizer* given,
                                                        std::vector<at::Tensor> params) {
  SHOAL_CHECK_T(InvalidArgument, given != nullptr && given->param_groups().size() == 1,
                "--strategy fsdp: the optimizer must have one parameter group");
  auto& options = given->param_groups().front().options();
  if (const auto* sgd = dynamic_cast<const torch::optim::SGDOptions*>(&options)) {
    return std::make_unique<torch::optim::SGD>(std::move(params), *sgd);
  }
  if (const auto* adam = dynamic_cast<const torch::optim::AdamOptions*>(&options)) {
    return std::make_unique<torch::optim::Adam>(std::move(params), *adam);
  }
  SHOAL_THROW(InvalidArgument, "--strategy fsdp steps SGD or Adam on the shards; this optimizer "
              "is neither");
}

}  // namespace

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
  state.optimizer = same_optimizer(state.optimizer.get(), fsdp->parameters());
  state.forward = [fsdp, forward = state.model_forward](const at::Tensor& input) {
    fsdp->prepare_for_forward();
    at::Tensor output = forward(input);
    fsdp->prepare_for_backward(output);
    return output;
  };
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
