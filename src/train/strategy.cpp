#include "shoal/train/strategy.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>

#include "shoal/checkpoint/checkpoint_manager.h"
#include "shoal/comm/process_group.h"
#include "shoal/data/distributed_sampler.h"
#include "shoal/data/exactly_once_sampler.h"
#include "shoal/error.h"
#include "shoal/train/clip_grad.h"
#include "shoal/train/trainer.h"

namespace shoal::train {

void check_strategy_device(const std::string& device, bool trains_on_gpu,
                           const std::string& strategy) {
  SHOAL_CHECK_T(InvalidArgument, device == "cpu" || trains_on_gpu, "--device ", device,
                ": --strategy ", strategy,
                " trains on the CPU here; on a GPU, use --strategy single or plain ddp (without "
                "--fault-tolerant, --sync localsgd|diloco or --model-parallel)");
}

void Strategy::prepare(TrainState& state) {
  state.forward = state.model_forward;
  state.forward_loss = state.model_loss;
}

torch::optim::Optimizer* Strategy::checkpoint_optimizer(TrainState& state) {
  return state.optimizer.get();
}

void Strategy::save_checkpoint(checkpoint::CheckpointManager& checkpoints,
                               const checkpoint::TrainingState& state) {
  checkpoints.save(state, process_group());
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

at::Tensor Strategy::epoch_indices(int64_t dataset_size, int64_t epoch, uint64_t seed,
                                   int64_t consumed) {
  const int64_t start = std::clamp<int64_t>(consumed, 0, dataset_size);
  return shuffled_indices(dataset_size, seed, epoch).slice(0, start);
}

namespace {

/// DistributedSampler's dealing of order[consumed:]: padded to a multiple of `replicas` by
/// repeating the order from its start (as often as it takes when the order is shorter than the
/// padding), this replica's every replicas-th from `replica`. With consumed 0, exactly
/// DistributedSampler(shuffle, drop_last=False).indices().
at::Tensor padded_share(const at::Tensor& order, int64_t consumed, int replica, int replicas) {
  const int64_t size = order.size(0);
  const int64_t rest = std::max<int64_t>(0, size - consumed);
  if (rest == 0) return at::empty({0}, at::kLong);
  const int64_t padding = (replicas - rest % replicas) % replicas;
  at::Tensor padded = order.slice(0, consumed);
  if (padding > 0) {
    const at::Tensor repeats = order.repeat({(padding + size - 1) / size});
    padded = at::cat({padded, repeats.slice(0, 0, padding)});
  }
  return padded.slice(0, replica, padded.size(0), replicas).contiguous();
}

}  // namespace

at::Tensor sampler_indices(int64_t dataset_size, int64_t epoch, uint64_t seed, int replica,
                           int replicas, bool exactly_once, int64_t consumed) {
  SHOAL_CHECK_T(InvalidArgument, consumed >= 0, "sampler_indices: ", consumed,
                " samples consumed of epoch ", epoch);
  if (exactly_once) {
    data::ExactlyOnceSamplerOptions dealing;
    dealing.seed = seed;
    dealing.drop_last = true;
    data::ExactlyOnceSampler sampler(dataset_size, replica, replicas, dealing);
    sampler.set_epoch(static_cast<uint64_t>(epoch), std::min(consumed, dataset_size));
    return sampler.indices();
  }
  // Checked here as DistributedSampler checks them, since it is not built.
  SHOAL_CHECK_T(InvalidArgument, replicas > 0 && replica >= 0 && replica < replicas,
                "sampler_indices: replica ", replica, " of ", replicas);
  const at::Tensor order = data::epoch_permutation(dataset_size, /*shuffle=*/true, seed,
                                                   static_cast<uint64_t>(epoch));
  return padded_share(order, consumed, replica, replicas);
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
