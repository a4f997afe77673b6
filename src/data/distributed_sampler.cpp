#include "shoal/data/distributed_sampler.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include "shoal/error.h"

namespace shoal::data {

at::Tensor epoch_permutation(int64_t size, bool shuffle, uint64_t seed, uint64_t epoch) {
  if (!shuffle || size == 0) return torch::arange(size, torch::kLong);
  // The same generator and randperm as Python's sampler, so the order is bit-identical.
  auto generator = at::make_generator<at::CPUGeneratorImpl>(seed + epoch);
  return torch::randperm(size, generator, torch::kLong);
}

DistributedSampler::DistributedSampler(size_t dataset_size, int rank, int num_replicas,
                                       DistributedSamplerOptions options)
    : dataset_size_(dataset_size), rank_(rank), num_replicas_(num_replicas), options_(options) {
  SHOAL_CHECK_T(InvalidArgument, num_replicas_ > 0, "DistributedSampler: num_replicas is ",
                num_replicas_, "; it must be positive");
  SHOAL_CHECK_T(InvalidArgument, rank_ >= 0 && rank_ < num_replicas_, "DistributedSampler: rank ",
                rank_, " is outside [0, ", num_replicas_ - 1, "]");
  compute_size();
  reset();
}

void DistributedSampler::compute_size() {
  const size_t n = dataset_size_;
  const size_t r = static_cast<size_t>(num_replicas_);
  if (options_.drop_last && n % r != 0) {
    num_samples_ = n >= r ? (n - r + r - 1) / r : 0;  // ceil((n - r) / r), as PyTorch
  } else {
    num_samples_ = (n + r - 1) / r;
  }
}

void DistributedSampler::set_epoch(uint64_t epoch) {
  epoch_ = epoch;
  reset();
}

std::vector<size_t> DistributedSampler::indices() const {
  const size_t n = dataset_size_;
  const size_t total = total_size();
  std::vector<size_t> all;
  all.reserve(std::max(n, total));
  const at::Tensor order =
      epoch_permutation(static_cast<int64_t>(n), options_.shuffle, options_.seed, epoch_);
  const int64_t* ordered = order.data_ptr<int64_t>();
  for (size_t i = 0; i < n; ++i) all.push_back(static_cast<size_t>(ordered[i]));
  if (!options_.drop_last) {
    // Pad by repeating from the start (several times when the dataset is smaller than the padding).
    for (size_t i = 0; all.size() < total; ++i) all.push_back(all[i % n]);
  } else {
    all.resize(total);
  }
  std::vector<size_t> mine;
  mine.reserve(num_samples_);
  for (size_t i = static_cast<size_t>(rank_); i < total; i += static_cast<size_t>(num_replicas_)) {
    mine.push_back(all[i]);
  }
  return mine;
}

void DistributedSampler::reset(c10::optional<size_t> new_size) {
  if (new_size.has_value()) {
    dataset_size_ = *new_size;
    compute_size();
  }
  current_ = indices();
  position_ = 0;
}

c10::optional<std::vector<size_t>> DistributedSampler::next(size_t batch_size) {
  if (position_ >= current_.size()) return c10::nullopt;
  const size_t end = std::min(current_.size(), position_ + batch_size);
  std::vector<size_t> batch(current_.begin() + static_cast<std::ptrdiff_t>(position_),
                            current_.begin() + static_cast<std::ptrdiff_t>(end));
  position_ = end;
  return batch;
}

void DistributedSampler::save(torch::serialize::OutputArchive& archive) const {
  archive.write("epoch", torch::tensor(static_cast<int64_t>(epoch_)), /*is_buffer=*/true);
  archive.write("position", torch::tensor(static_cast<int64_t>(position_)), /*is_buffer=*/true);
}

void DistributedSampler::load(torch::serialize::InputArchive& archive) {
  torch::Tensor epoch, position;
  archive.read("epoch", epoch, /*is_buffer=*/true);
  archive.read("position", position, /*is_buffer=*/true);
  set_epoch(static_cast<uint64_t>(epoch.item<int64_t>()));
  position_ = std::min(current_.size(), static_cast<size_t>(position.item<int64_t>()));
}

}  // namespace shoal::data
