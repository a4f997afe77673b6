#include "shoal/train/strategy.h"

#include <ATen/CPUGeneratorImpl.h>

#include "shoal/train/trainer.h"

namespace shoal::train {

void Strategy::prepare(TrainState& state) {
  std::shared_ptr<models::Model> model = state.model;
  state.forward = [model](const at::Tensor& input) { return model->forward(input); };
}

double Strategy::train_step(TrainState& state, const at::Tensor& inputs,
                            const at::Tensor& targets) {
  return train::train_step(state, inputs, targets);
}

at::Tensor Strategy::epoch_indices(int64_t dataset_size, int64_t epoch, uint64_t seed) {
  return shuffled_indices(dataset_size, seed, epoch);
}

at::Tensor shuffled_indices(int64_t size, uint64_t seed, int64_t epoch) {
  at::Generator generator =
      at::make_generator<at::CPUGeneratorImpl>(seed + static_cast<uint64_t>(epoch));
  return at::randperm(size, generator, at::kLong);
}

}  // namespace shoal::train
