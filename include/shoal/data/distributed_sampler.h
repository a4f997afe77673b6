// DistributedSampler: each rank's share of a dataset's indices, with PyTorch's
// torch.utils.data.DistributedSampler semantics exactly.
//
// Every epoch, the indices 0..size-1 (shuffled with torch.randperm under a generator seeded with
// seed + epoch, bit-identical to Python's sampler) are padded by repeating from the start until
// they divide evenly among the ranks (or, with drop_last, the tail is dropped), and rank r takes
// indices r, r + num_replicas, r + 2 * num_replicas, ... Every rank gets the same count, so every
// rank runs the same number of steps. Call set_epoch(epoch) before each epoch, or every epoch
// repeats the first epoch's order.
//
// Also a torch::data sampler (reset / next(batch_size)), usable with torch::data::make_data_loader.
//
// Thread safety: not thread-safe; one instance per rank.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/data/samplers/base.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace shoal::data {

/// An epoch's order of `size` indices, [size] int64: torch.randperm(size) under a CPU generator
/// seeded with seed + epoch (Python's DistributedSampler and Shoal's samplers all shuffle so), or
/// 0..size-1 without `shuffle`.
at::Tensor epoch_permutation(int64_t size, bool shuffle, uint64_t seed, uint64_t epoch);

struct DistributedSamplerOptions {
  bool shuffle = true;
  uint64_t seed = 0;
  bool drop_last = false;
};

class DistributedSampler : public torch::data::samplers::Sampler<std::vector<size_t>> {
 public:
  /// `dataset_size` items shared among `num_replicas` ranks; this is `rank`.
  DistributedSampler(size_t dataset_size, int rank, int num_replicas,
                     DistributedSamplerOptions options = {});
  /// The short form of the design example: shuffle on or off, seed 0, no drop_last.
  DistributedSampler(size_t dataset_size, int rank, int num_replicas, bool shuffle)
      : DistributedSampler(dataset_size, rank, num_replicas, DistributedSamplerOptions{shuffle}) {}

  /// Selects the epoch's shuffle (seed + epoch) and rewinds.
  void set_epoch(uint64_t epoch);
  uint64_t epoch() const { return epoch_; }

  /// This rank's indices for the current epoch, in order.
  std::vector<size_t> indices() const;
  /// How many indices each rank gets per epoch (PyTorch's len(sampler)).
  size_t size() const { return num_samples_; }
  /// num_replicas * size().
  size_t total_size() const { return num_samples_ * static_cast<size_t>(num_replicas_); }

  int rank() const { return rank_; }
  int num_replicas() const { return num_replicas_; }

  // torch::data::samplers::Sampler
  /// Rewinds to the start of the epoch; a new size re-partitions the dataset.
  void reset(c10::optional<size_t> new_size = c10::nullopt) override;
  /// The next up to `batch_size` indices of this rank, or nullopt at the end of the epoch.
  c10::optional<std::vector<size_t>> next(size_t batch_size) override;
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

 private:
  void compute_size();

  size_t dataset_size_;
  int rank_;
  int num_replicas_;
  DistributedSamplerOptions options_;
  uint64_t epoch_ = 0;
  size_t num_samples_ = 0;
  std::vector<size_t> current_;
  size_t position_ = 0;
};

}  // namespace shoal::data
