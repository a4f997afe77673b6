#include "shoal/train/distributed_indices.h"

#include <ATen/ATen.h>

#include "shoal/data/distributed_sampler.h"

namespace shoal::train {

at::Tensor distributed_epoch_indices(int64_t dataset_size, int rank, int world_size,
                                     int64_t epoch, uint64_t seed) {
  data::DistributedSamplerOptions options;
  options.shuffle = true;
  options.seed = seed;
  data::DistributedSampler sampler(static_cast<size_t>(dataset_size), rank, world_size, options);
  sampler.set_epoch(static_cast<uint64_t>(epoch));
  const std::vector<size_t> indices = sampler.indices();
  at::Tensor result = at::empty({static_cast<int64_t>(indices.size())}, at::kLong);
  int64_t* out = result.data_ptr<int64_t>();
  for (size_t i = 0; i < indices.size(); ++i) out[i] = static_cast<int64_t>(indices[i]);
  return result;
}

}  // namespace shoal::train
