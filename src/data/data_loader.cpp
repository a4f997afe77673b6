#include "shoal/data/data_loader.h"

#include <ATen/ATen.h>

#include "compat/thread_parallelism.h"
#include "shoal/error.h"

namespace shoal::data {

DataLoader::DataLoader(const BatchDataset& dataset, at::Tensor indices, DataLoaderOptions options)
    : dataset_(dataset), indices_(std::move(indices)), options_(options) {
  SHOAL_CHECK_T(InvalidArgument, options_.batch_size >= 1, "DataLoader: batch_size must be >= 1, got ",
                options_.batch_size);
  SHOAL_CHECK_T(InvalidArgument, options_.num_workers >= 0 && options_.num_workers <= 256,
                "DataLoader: num_workers must be in [0, 256], got ", options_.num_workers);
  SHOAL_CHECK_T(InvalidArgument, options_.prefetch_factor >= 1 && options_.prefetch_factor <= 1024,
                "DataLoader: prefetch_factor must be in [1, 1024], got ", options_.prefetch_factor);
  SHOAL_CHECK_T(InvalidArgument, options_.timeout.count() > 0, "DataLoader: timeout must be > 0");
  SHOAL_CHECK_T(InvalidArgument, indices_.defined() && indices_.dim() == 1,
                "DataLoader: indices must be a 1-dimensional tensor");
  indices_ = indices_.to(at::kLong).contiguous();
  const int64_t n = indices_.size(0);
  num_batches_ = options_.drop_last ? n / options_.batch_size
                                    : (n + options_.batch_size - 1) / options_.batch_size;
  worker_count_ = static_cast<int>(std::min<int64_t>(options_.num_workers, num_batches_));
  workers_.reserve(static_cast<size_t>(worker_count_));
  for (int w = 0; w < worker_count_; ++w) workers_.emplace_back([this, w] { work(w); });
}

DataLoader::~DataLoader() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  room_.notify_all();
  for (std::thread& worker : workers_) worker.join();
}

Batch DataLoader::load(int64_t batch) const {
  const int64_t begin = batch * options_.batch_size;
  const int64_t end = std::min(indices_.size(0), begin + options_.batch_size);
  return dataset_.get_batch(indices_.slice(0, begin, end));
}

void DataLoader::work(int worker) {
  // Loading must not take cores from the step: this thread's tensor work stays on it.
  compat::run_intra_op_serially_on_this_thread();
  const int64_t stride = worker_count_;
  // Loaded and not yet taken: at most this many batches ahead of next().
  const int64_t ahead = stride * options_.prefetch_factor;
  for (int64_t batch = worker; batch < num_batches_; batch += stride) {
    {
      std::unique_lock<std::mutex> lock(mutex_);
      room_.wait(lock, [&] { return stopping_ || batch < next_ + ahead; });
      if (stopping_) return;
    }
    std::optional<Batch> result;
    std::exception_ptr error;
    try {
      result = load(batch);
    } catch (...) {
      error = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (error) {
        failed_.emplace(batch, error);
      } else {
        loaded_.emplace(batch, std::move(*result));
      }
    }
    ready_.notify_one();
    if (error) return;  // next() stops at this batch
  }
}

std::optional<Batch> DataLoader::next() {
  if (next_ >= num_batches_) return std::nullopt;
  const int64_t batch = next_;
  if (worker_count_ == 0) {
    ++next_;
    return load(batch);
  }
  std::unique_lock<std::mutex> lock(mutex_);
  const bool arrived = ready_.wait_for(lock, options_.timeout, [&] {
    return loaded_.count(batch) > 0 || failed_.count(batch) > 0;
  });
  SHOAL_CHECK_T(TimeoutError, arrived, "DataLoader: batch ", batch, " of ", num_batches_,
                " not loaded after ", options_.timeout.count(), " ms (worker ",
                batch % worker_count_, " of ", worker_count_,
                "): the dataset's get_batch does not return");
  const auto failure = failed_.find(batch);
  if (failure != failed_.end()) std::rethrow_exception(failure->second);
  auto it = loaded_.find(batch);
  Batch result = std::move(it->second);
  loaded_.erase(it);
  ++next_;
  lock.unlock();
  room_.notify_all();
  return result;
}

}  // namespace shoal::data
