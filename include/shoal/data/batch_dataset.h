// What the trainer reads its samples from: a dataset that hands out a whole batch for a list of
// indices (torch::data's BatchDataset shape, and what PyTorch's DataLoader asks of a map-style
// dataset through its sampler), so that a dataset too large for memory, or read lazily from files,
// trains as in-memory tensors do.
//
//   TensorDataset      in-memory tensors (PyTorch's torch.utils.data.TensorDataset); a batch is
//                      one index_select per tensor.
//   MapDatasetAdapter  any torch::data dataset with get(index) / size() (the LibTorch way of
//                      writing a dataset): a batch stacks get() of each index.
//   Cifar10            the CIFAR-10 binary files, read record by record (data/cifar10.h).
//
// The DataLoader (data/data_loader.h) calls get_batch() from its worker threads, several batches
// at once: an implementation must be safe to call concurrently (const, or locking inside).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/data/example.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace shoal::data {

/// Inputs [B, ...] and targets [B, ...] of one batch.
using Batch = torch::data::Example<>;

/// A map-style dataset read a batch at a time.
class BatchDataset {
 public:
  virtual ~BatchDataset() = default;
  /// The number of samples.
  virtual int64_t size() const = 0;
  /// The samples at `indices` ([k] int64, each in [0, size())), in that order, stacked into one
  /// batch. Called concurrently from the DataLoader's workers.
  virtual Batch get_batch(const at::Tensor& indices) const = 0;
  /// Selects the epoch whose random choices (augmentation) the samples take, as a sampler's
  /// set_epoch selects its shuffle: called before each epoch's DataLoader starts, never while one
  /// runs. Const because the samples' source does not change, only which draw each one takes; a
  /// dataset without random choices ignores it.
  virtual void set_epoch(int64_t epoch) const {}
  /// True when an epoch must visit each sample exactly once across the job (a token stream's
  /// blocks: no sample repeated to pad the ranks' shares); the trainer then deals the epoch with
  /// ExactlyOnceSampler and drop_last. False: DistributedSampler's padded shares.
  virtual bool deal_exactly_once() const { return false; }
};

/// In-memory inputs [N, ...] and targets [N, ...]: PyTorch's TensorDataset of two tensors.
class TensorDataset : public BatchDataset {
 public:
  /// Throws InvalidArgument when a tensor is undefined or their first dimensions differ.
  TensorDataset(at::Tensor inputs, at::Tensor targets);
  int64_t size() const override { return inputs_.size(0); }
  Batch get_batch(const at::Tensor& indices) const override;
  const at::Tensor& inputs() const { return inputs_; }
  const at::Tensor& targets() const { return targets_; }

 private:
  at::Tensor inputs_;
  at::Tensor targets_;
};

/// Stacks a batch out of a torch::data dataset's single samples (get(index) -> Example<>).
/// The dataset's get() is called under a lock unless `concurrent_get` says it is safe to call
/// from several threads at once (torch::data's get() is not const, so by default it is not).
template <typename Dataset>
class MapDatasetAdapter : public BatchDataset {
 public:
  explicit MapDatasetAdapter(std::shared_ptr<Dataset> dataset, bool concurrent_get = false)
      : dataset_(std::move(dataset)), concurrent_get_(concurrent_get) {}
  int64_t size() const override { return static_cast<int64_t>(dataset_->size().value()); }
  Batch get_batch(const at::Tensor& indices) const override {
    const at::Tensor cpu = indices.to(at::kLong).contiguous();
    const int64_t* index = cpu.data_ptr<int64_t>();
    std::vector<at::Tensor> inputs;
    std::vector<at::Tensor> targets;
    inputs.reserve(static_cast<size_t>(cpu.numel()));
    targets.reserve(static_cast<size_t>(cpu.numel()));
    for (int64_t i = 0; i < cpu.numel(); ++i) {
      torch::data::Example<> example = get(static_cast<size_t>(index[i]));
      inputs.push_back(std::move(example.data));
      targets.push_back(std::move(example.target));
    }
    return {at::stack(inputs), at::stack(targets)};
  }

 private:
  torch::data::Example<> get(size_t index) const {
    if (concurrent_get_) return dataset_->get(index);
    std::lock_guard<std::mutex> lock(mutex_);
    return dataset_->get(index);
  }
  std::shared_ptr<Dataset> dataset_;
  bool concurrent_get_;
  mutable std::mutex mutex_;
};

/// The samples [begin, end) of `dataset` (a contiguous shard, e.g. each rank's share of the test
/// set); indices are relative to `begin`.
class SubsetDataset : public BatchDataset {
 public:
  /// Throws InvalidArgument unless 0 <= begin <= end <= dataset.size(). `dataset` must outlive
  /// the subset.
  SubsetDataset(const BatchDataset& dataset, int64_t begin, int64_t end);
  int64_t size() const override { return end_ - begin_; }
  Batch get_batch(const at::Tensor& indices) const override;
  void set_epoch(int64_t epoch) const override { dataset_->set_epoch(epoch); }

 private:
  const BatchDataset* dataset_;  // not owned
  int64_t begin_;
  int64_t end_;
};

}  // namespace shoal::data
