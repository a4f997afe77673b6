// SyncBatchNorm: batch normalisation whose batch statistics are computed over the whole global
// batch (every rank's samples) through allreduces, forward and backward (PyTorch's
// torch.nn.SyncBatchNorm); and convert_sync_batchnorm, which swaps BatchNorm1d/2d/3d for it.
//
// Parameters and buffers carry BatchNorm's names (weight, bias, running_mean, running_var,
// num_batches_tracked), so state dicts are interchangeable. In evaluation mode it is a plain
// BatchNorm over the running statistics (no communication).
//
// Thread safety: like any module, driven by one thread; its collectives are issued on that thread
// in forward and backward, in the same order on every rank (so every rank must run it).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/options/batchnorm.h>
#include <torch/nn/pimpl.h>

#include <memory>

#include "shoal/comm/process_group.h"

namespace shoal::parallel {

class SyncBatchNormImpl : public torch::nn::Cloneable<SyncBatchNormImpl> {
 public:
  SyncBatchNormImpl(torch::nn::BatchNormOptions options, std::shared_ptr<comm::ProcessGroup> group);
  SyncBatchNormImpl(int64_t num_features, std::shared_ptr<comm::ProcessGroup> group)
      : SyncBatchNormImpl(torch::nn::BatchNormOptions(num_features), std::move(group)) {}

  /// Input (N, C, ...); normalises each channel over N and the trailing dimensions of every rank.
  at::Tensor forward(const at::Tensor& input);
  void reset() override;

  torch::nn::BatchNormOptions options;
  std::shared_ptr<comm::ProcessGroup> group;
  at::Tensor weight, bias, running_mean, running_var, num_batches_tracked;
};
TORCH_MODULE(SyncBatchNorm);

/// Converts every BatchNorm1d/2d/3d in `module`'s tree to a SyncBatchNorm over `group`, keeping
/// names, parameters, buffers and training mode (PyTorch's SyncBatchNorm.convert_sync_batchnorm).
/// A BatchNorm module itself is returned converted; otherwise the tree is changed in place and
/// `module` returned: a BatchNorm inside a torch::nn::Sequential, ModuleList or ModuleDict at any
/// depth is replaced there (the container is updated in place, so typed members holding it see
/// the change). C++ modules keep other children in typed members that cannot be swapped from
/// outside, so a BatchNorm held directly by a custom module throws InvalidArgument naming its
/// path: declare that layer as SyncBatchNorm.
std::shared_ptr<torch::nn::Module> convert_sync_batchnorm(std::shared_ptr<torch::nn::Module> module,
                                                          std::shared_ptr<comm::ProcessGroup> group);

}  // namespace shoal::parallel
