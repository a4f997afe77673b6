#include "shoal/parallel/comm_hooks.h"

#include <torch/torch.h>

#include <mutex>

#include "shoal/error.h"

namespace shoal::parallel {
namespace {

// A Work that runs a continuation once, on the first successful wait.
class ThenWork : public comm::Work {
 public:
  ThenWork(std::shared_ptr<comm::Work> inner, std::function<void()> then)
      : comm::Work(inner->label()),
        inner_(std::move(inner)),
        then_(std::move(then)) {}

  bool is_completed() override { return inner_->is_completed(); }
  std::exception_ptr exception() override { return inner_->exception(); }
  void wait(comm::Milliseconds timeout) override {
    inner_->wait(timeout);
    std::lock_guard<std::mutex> lock(mutex_);
    if (!done_) {
      then_();
      done_ = true;
    }
  }

 private:
  std::shared_ptr<comm::Work> inner_;
  std::function<void()> then_;
  std::mutex mutex_;
  bool done_ = false;
};

CommHook compress_hook(std::shared_ptr<comm::ProcessGroup> group, at::ScalarType wire_type) {
  SHOAL_CHECK_T(InvalidArgument, group != nullptr, "comm hook: the process group is null");
  return [group, wire_type](GradBucket& bucket) {
    torch::NoGradGuard no_grad;
    // Divide before the sum (as PyTorch does) so that the reduced half-precision values stay in range.
    auto compressed = bucket.buffer().to(wire_type).div_(group->size());
    comm::AllreduceOptions options;
    options.check = false;  // identical on every rank by construction, as in allreduce_hook
    auto work = group->allreduce(compressed, options);
    at::Tensor buffer = bucket.buffer();
    return then(std::move(work), [buffer, compressed]() mutable {
      torch::NoGradGuard no_grad;
      buffer.copy_(compressed);
    });
  };
}

}  // namespace

std::shared_ptr<comm::Work> then(std::shared_ptr<comm::Work> work, std::function<void()> then) {
  SHOAL_CHECK_T(InvalidArgument, work != nullptr, "then(): the work is null");
  return std::make_shared<ThenWork>(std::move(work), std::move(then));
}

CommHook allreduce_hook(std::shared_ptr<comm::ProcessGroup> group) {
  SHOAL_CHECK_T(InvalidArgument, group != nullptr, "allreduce_hook: the process group is null");
  return [group](GradBucket& bucket) {
    // Averaging inside the collective: the shm backend divides in the same pass that sums (one
    // pass over the bucket fewer on the training thread than dividing first, as PyTorch does);
    // other backends divide the summed result. float32 gradients do not overflow either way.
    comm::AllreduceOptions options;
    options.op = comm::ReduceOp::kAvg;
    // The buckets are the same on every rank by construction (DDP verified the parameters and
    // every rank builds the same buckets), so the per-collective check would only add a blocking
    // round trip before each bucket's reduction.
    options.check = false;
    return group->allreduce(bucket.buffer(), options);
  };
}

CommHook fp16_compress_hook(std::shared_ptr<comm::ProcessGroup> group) {
  return compress_hook(std::move(group), at::kHalf);
}

CommHook bf16_compress_hook(std::shared_ptr<comm::ProcessGroup> group) {
  return compress_hook(std::move(group), at::kBFloat16);
}

}  // namespace shoal::parallel
