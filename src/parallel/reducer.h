// Reducer: the gradient bucketing, overlap and averaging engine behind DistributedDataParallel.
//
// Owns the buckets (flat gradient tensors), the hooks on every parameter's gradient accumulator and
// the end-of-backward callback. See distributed_data_parallel.h for the algorithm and the order of
// collectives.
//
// Thread safety: driven by one thread (the one running forward/backward on this rank).
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "compat/autograd_hooks.h"
#include "shoal/comm/process_group.h"
#include "shoal/parallel/distributed_data_parallel.h"

namespace shoal::parallel {

class Reducer {
 public:
  /// `parameters` in registration order (only those requiring grad), with their names.
  Reducer(std::vector<at::Tensor> parameters, std::vector<std::string> names,
          std::shared_ptr<comm::ProcessGroup> group, const DistributedDataParallelOptions& options);
  ~Reducer();
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  void set_comm_hook(CommHook hook);
  /// False inside no_sync(): hooks let gradients accumulate in .grad.
  void set_grad_sync(bool enabled) { grad_sync_ = enabled; }
  bool grad_sync() const { return grad_sync_; }

  /// With find_unused_parameters: finds the parameters `outputs` do not depend on.
  void prepare_for_backward(const std::vector<at::Tensor>& outputs);
  /// Once, on every rank at the same step: rebuilds buckets from rank 0's gradient arrival order.
  void rebuild_buckets();
  bool buckets_rebuilt() const { return rebuilt_; }
  /// A joined rank's side of one step: reduces zero buckets with the others.
  void shadow_backward();

  ReducerStats stats() const;

 private:
  struct Bucket {
    at::Tensor contents;                 // flat gradients
    std::vector<size_t> variables;       // parameter indices, in slice order
    std::vector<at::Tensor> views;       // slices of contents shaped like the parameters
    size_t pending = 0;                  // gradients still missing this iteration
    std::shared_ptr<comm::Work> work;    // the reduction in flight
    // What the communication hook sees, built with the bucket: launching a reduction from the
    // backward hook then allocates nothing.
    std::unique_ptr<GradBucket> hook_view;
  };

  void build_buckets(const std::vector<size_t>& order);
  void autograd_hook(size_t index);
  void begin_backward();
  void mark_ready(size_t index, bool used);
  void launch_ready_buckets();
  std::shared_ptr<comm::Work> launch(size_t bucket_index);
  void finalize_backward();
  void wait_bucket(size_t bucket_index);
  std::string describe_bucket(size_t bucket_index) const;

  std::vector<at::Tensor> params_;
  std::vector<std::string> names_;
  std::shared_ptr<comm::ProcessGroup> group_;
  DistributedDataParallelOptions options_;
  CommHook hook_;
  std::vector<std::unique_ptr<compat::GradAccumulatedHook>> hooks_;

  std::vector<Bucket> buckets_;
  std::vector<std::pair<size_t, size_t>> locator_;  // parameter -> (bucket, slot)

  bool grad_sync_ = true;
  bool in_backward_ = false;
  size_t next_bucket_ = 0;               // first bucket not launched yet
  std::vector<char> ready_;              // per parameter, this iteration
  std::vector<char> locally_used_;       // per parameter, got a real gradient this iteration
  std::vector<size_t> unused_;           // from prepare_for_backward (find_unused_parameters)
  bool unused_known_ = false;

  bool rebuilt_ = false;
  std::vector<size_t> arrival_order_;    // first backward's gradient order
  bool recording_order_ = true;

  std::chrono::steady_clock::time_point backward_start_;
  ReducerStats stats_;
};

}  // namespace shoal::parallel
