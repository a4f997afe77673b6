// HostStaging: runs an operation of a backend that works on host memory (shm, gloo, mpi,
// hierarchical) on CUDA tensors, as PyTorch's gloo does: each CUDA tensor is copied into a pinned
// host tensor before the operation, the backend works on the host copies, and the outputs are
// copied back to the device once the operation has completed (when its Work is waited for, or
// first seen completed). Used by ProcessGroup's public methods only; CPU tensors pass through
// untouched, at no cost.
//
// Thread safety: one staging per operation, built on the issuing thread; the Work it returns is
// as thread-safe as any Work.
#pragma once

#include <ATen/core/Tensor.h>

#include <list>
#include <memory>
#include <vector>

#include "shoal/comm/work.h"

namespace shoal::comm {

class HostStaging {
 public:
  /// `stage_cuda`: whether CUDA tensors must be staged (the backend does not take them).
  explicit HostStaging(bool stage_cuda);

  /// The tensor the backend should see for `tensor`: itself, or a pinned host copy of it. `read`:
  /// the backend reads it (copied in); `written`: the backend writes it (copied back).
  at::Tensor& tensor(at::Tensor& tensor, bool read, bool written);
  const at::Tensor& input(const at::Tensor& tensor) {
    return this->tensor(const_cast<at::Tensor&>(tensor), true, false);
  }
  /// The same for a list (every element staged when any is a CUDA tensor).
  std::vector<at::Tensor>& list(std::vector<at::Tensor>& tensors, bool read, bool written);

  /// `work` itself when nothing was staged; otherwise a Work that completes when `work` has and
  /// the outputs are back on their device.
  std::shared_ptr<Work> finish(std::shared_ptr<Work> work);

  struct State;  ///< the host copies and what to copy back (host_staging.cpp)

 private:
  bool stage_cuda_;
  std::shared_ptr<State> state_;  // null until a tensor is staged
};

}  // namespace shoal::comm
