#include "shoal/train/strategy.h"

#include <ATen/CPUGeneratorImpl.h>

#include "shoal/comm/process_group.h"
#include "shoal/data/distributed_sampler.h"
#include "shoal/data/exactly_once_sampler.h"
#include "shoal/train/clip_grad.h"
#include "shoal/train/trainer.h"

namespace shoal::train {

void Strategy::prepare(TrainState& state) {
  state.forward = state.model_forward;
  state.forward_loss = state.model_loss;
}

torch::optim::Optimizer* Strategy::checkpoint_optimizer(TrainState& state) {
  return state.optimizer.get();
}

bool Strategy::sharded_checkpoint(TrainState&, checkpoint::ShardedTrainingState&) {
  return false;
}

double Strategy::train_step(TrainState& state, const at::Tensor& inputs,
                            const at::Tensor& targets) {
  return train::train_step(state, inputs, targets);
}

double Strategy::clip_grad_norm(TrainState& state, double max_norm) {
  return clip_grad_norm_(state.model->parameters(), max_norm);
}

double Strategy::grad_norm(TrainState& state) {
  return total_grad_norm(state.model->parameters());  // what clip_grad_norm_ would clip
}

at::Tensor Strategy::epoch_indices(int64_t dataset_size, int64_t epoch, uint64_t seed) {
  return shuffled_indices(dataset_size, seed, epoch);
}

at::Tensor sampler_indices(int64_t dataset_size, int64_t epoch, uint64_t seed, int replica,
                           int replicas, bool exactly_once) {
  if (exactly_once) {
    data::ExactlyOnceSamplerOptions dealing;
    dealing.seed = seed;
    dealing.drop_last = true;
    data::ExactlyOnceSampler sampler(dataset_size, replica, replicas, dealing);
    sampler.set_epoch(static_cast<uint64_t>(epoch));
    return sampler.indices();
  }
  data::DistributedSamplerOptions options;
  options.shuffle = true;
  options.seed = seed;
  data::DistributedSampler sampler(static_cast<size_t>(dataset_size), replica, replicas, options);
  sampler.set_epoch(static_cast<uint64_t>(epoch));
  const std::vector<size_t> indices = sampler.indices();
  at::Tensor result = at::empty({static_cast<int64_t>(indices.size())}, at::kLong);
  int64_t* out = result.data_ptr<int64_t>();
  for (size_t i = 0; i < indices.size(); ++i) out[i] = static_cast<int64_t>(indices[i]);
  return result;
}

void all_reduce_sum(comm::ProcessGroup& group, std::vector<double>& values) {
  if (values.empty()) return;
  at::Tensor tensor = at::tensor(values, at::kDouble);
  group.allreduce(tensor)->wait();
  const double* sums = tensor.data_ptr<double>();
  for (size_t i = 0; i < values.size(); ++i) values[i] = sums[i];
}

at::Tensor shuffled_indices(int64_t size, uint64_t seed, int64_t epoch) {
  at::Generator generator =
      at::make_generator<at::CPUGeneratorImpl>(seed + static_cast<uint64_t>(epoch));
  return at::randperm(size, generator, at::kLong);
}

}  // namespace shoal::train
