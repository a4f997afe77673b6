// GradBucket and CommHook: what a communication hook of DistributedDataParallel sees and returns
// (PyTorch's torch.distributed.GradBucket and DistributedDataParallel.register_comm_hook).
//
// A hook receives one bucket of flattened gradients as soon as every gradient in it is ready and
// returns the pending communication. Contract: once the returned Work's wait() returns, buffer()
// holds the gradients every rank is to apply — already averaged (the default hook allreduces with
// ReduceOp::kAvg). Like the value of PyTorch's future, the result may be a new tensor: assign it
// to buffer() (in the hook or in its then() continuation) and DDP copies it into the bucket.
// Hooks run on the thread executing backward, one bucket at a time, buckets in the same order on
// every rank.
//
// Thread safety: DDP builds one GradBucket per bucket when it lays the buckets out and passes the
// same object every iteration; a hook may use it until its Work completed.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "shoal/comm/work.h"

namespace shoal::parallel {

class GradBucket {
 public:
  GradBucket(size_t index, bool is_last, at::Tensor buffer, std::vector<at::Tensor> gradients,
             std::vector<at::Tensor> parameters)
      : index_(index),
        is_last_(is_last),
        buffer_(std::move(buffer)),
        gradients_(std::move(gradients)),
        parameters_(std::move(parameters)) {}

  /// Position of the bucket (0 is reduced first, and holds the last registered parameters).
  size_t index() const { return index_; }
  /// True for the last bucket of the iteration.
  bool is_last() const { return is_last_; }
  /// The flat gradients of every parameter of the bucket; the hook reduces it in place.
  at::Tensor& buffer() { return buffer_; }
  /// Views into buffer() shaped like each parameter.
  const std::vector<at::Tensor>& gradients() const { return gradients_; }
  /// The bucket's parameters, in the order of their slices in buffer().
  const std::vector<at::Tensor>& parameters() const { return parameters_; }
  /// "bucket 3: fc2.weight, fc2.bias" (DDP sets it): pass it as AllreduceOptions::note so that
  /// hang reports say which bucket an allreduce was.
  const std::string& note() const { return note_; }
  void set_note(std::string note) { note_ = std::move(note); }

 private:
  size_t index_;
  bool is_last_;
  at::Tensor buffer_;
  std::vector<at::Tensor> gradients_;
  std::vector<at::Tensor> parameters_;
  std::string note_;
};

/// A communication hook: starts reducing the bucket, returns the pending work (see the contract
/// above). Capture the process group and any state in the function object.
using CommHook = std::function<std::shared_ptr<comm::Work>(GradBucket& bucket)>;

/// A Work that runs `then` (once, on the waiting thread) after `work` completed successfully:
/// how a hook decompresses or post-processes a bucket after the collective.
std::shared_ptr<comm::Work> then(std::shared_ptr<comm::Work> work, std::function<void()> then);

}  // namespace shoal::parallel
