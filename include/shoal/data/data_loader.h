// One epoch of batches, loaded ahead of the training step by worker threads: the C++ counterpart
// of PyTorch's torch.utils.data.DataLoader over a map-style dataset and a sampler.
//
//   DataLoaderOptions options;
//   options.batch_size = 64;
//   options.num_workers = 2;       // PyTorch's num_workers (threads here, not processes)
//   options.prefetch_factor = 2;   // batches each worker loads ahead
//   DataLoader loader(dataset, sampler_indices, options);
//   while (std::optional<Batch> batch = loader.next()) train(batch->data, batch->target);
//
// `indices` is the epoch's order (a DistributedSampler shard, a shuffle, or 0..N-1); batch b holds
// indices[b * batch_size, (b + 1) * batch_size). Batches come out in that order whatever the number
// of workers, so the samples a step sees do not depend on it: worker w loads batches w, w + W,
// w + 2W, ... (PyTorch's round-robin), and at most num_workers * prefetch_factor batches are loaded
// and not yet taken (PyTorch's bound). With num_workers 0, next() loads the batch itself.
//
// A batch whose loading threw rethrows from the next() that reaches it. next() waits for a batch
// at most `timeout` (a worker stuck on a file system that does not answer becomes a TimeoutError
// naming the batch and the worker, never a hang). The destructor stops the workers and joins them.
//
// Thread safety: one thread calls next(); the workers call the dataset's get_batch concurrently.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "shoal/data/batch_dataset.h"

namespace shoal::data {

struct DataLoaderOptions {
  /// Samples per batch; the last batch of an epoch may be smaller (drop_last false).
  int64_t batch_size = 64;
  /// Threads that load batches ahead of next(); 0 loads each batch in next() (PyTorch's default).
  int num_workers = 0;
  /// Batches each worker loads ahead (PyTorch's prefetch_factor, default 2).
  int prefetch_factor = 2;
  /// Drop a last batch smaller than batch_size.
  bool drop_last = false;
  /// How long next() waits for one batch before throwing TimeoutError.
  std::chrono::milliseconds timeout{std::chrono::minutes(10)};
};

class DataLoader {
 public:
  /// Loads the batches of `indices` ([k] int64) from `dataset`, which must outlive the loader.
  /// Throws InvalidArgument for options that cannot work.
  DataLoader(const BatchDataset& dataset, at::Tensor indices, DataLoaderOptions options = {});
  ~DataLoader();
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;

  /// The next batch in order, or nullopt after the last one.
  std::optional<Batch> next();
  /// Batches in the epoch.
  int64_t num_batches() const { return num_batches_; }

 private:
  Batch load(int64_t batch) const;
  void work(int worker);

  const BatchDataset& dataset_;
  at::Tensor indices_;
  DataLoaderOptions options_;
  int64_t num_batches_ = 0;
  int64_t next_ = 0;  // the batch next() returns next
  int worker_count_ = 0;  // set before the workers start

  std::mutex mutex_;
  std::condition_variable ready_;   // a batch was loaded (next() waits)
  std::condition_variable room_;    // next() took a batch (workers wait for room)
  std::map<int64_t, Batch> loaded_;
  std::map<int64_t, std::exception_ptr> failed_;
  bool stopping_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace shoal::data
