// ModelParallel: a torch::nn::Sequential split into consecutive parts on different devices, in one
// process (PyTorch's "model parallel" recipe: layers on cuda:0 and cuda:1, activations moved
// between them in forward, their gradients back in backward).
//
//   auto net = torch::nn::Sequential(...);
//   shoal::pipeline::ModelParallel mp(net, {at::Device("cuda:0"), at::Device("cuda:1")});  // even
//   auto loss = criterion(mp->forward(x), y);  // x moved to part 0's device, output on the last's
//   loss.backward();                           // autograd carries gradients across the devices
//
// Placement: either an even split into K parts by parameter count (contiguous parts that minimise
// the largest part's parameter count; every part holds at least one child), or an explicit map
// from child name ("0", "1", ... or the Sequential's own names) to device, where consecutive
// children on the same device form one part. Each child is moved to its part's device.
//
// Micro-batching (options.chunks = M > 1): the batch is split along dim into M micro-batches that
// flow through the parts concurrently, one persistent thread per part (GPipe's forward schedule:
// part p works on micro-batch m while part p+1 works on m-1); the outputs are concatenated. The
// backward pass then runs as LibTorch schedules it (on GPUs, each device's engine thread; on CPU,
// the caller's thread). Results equal the unsplit model's unless a layer mixes samples across the
// batch (BatchNorm in training mode sees micro-batches, as in PyTorch's Pipe).
//
// State dict: the children are registered under their Sequential names, so the keys are the bare
// Sequential's ("0.weight", ...). Because ModelParallel is a module with forward(Tensor), it can be
// wrapped by DistributedDataParallel (one process per rank, each holding a model split over its own
// devices: PyTorch's "DDP with model parallel").
//
// Thread safety: one thread calls forward at a time; the part threads run only inside forward.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace shoal::parallel {
class ReplicaThreads;
}

namespace shoal::pipeline {

struct ModelParallelOptions {
  /// Micro-batches per forward (1: the parts run one after the other on the caller's thread).
  TORCH_ARG(int64_t, chunks) = 1;
  /// The batch dimension micro-batches are cut along.
  TORCH_ARG(int64_t, dim) = 0;
  /// Intra-op threads of each part's thread when chunks > 1 on CPU (0: LibTorch's default).
  TORCH_ARG(int, intra_op_threads) = 1;
  /// How long one forward may wait for a part before it fails.
  TORCH_ARG(std::chrono::milliseconds, timeout) = std::chrono::minutes(30);
};

/// Splits `parameter_counts` (one per child, in order) into `parts` contiguous non-empty ranges
/// minimising the largest range's sum; returns each range's first index (first is 0).
std::vector<size_t> balanced_split(const std::vector<int64_t>& parameter_counts, size_t parts);

class ModelParallelImpl : public torch::nn::Module {
 public:
  /// Even split by parameter count: part p on devices[p] (devices.size() parts).
  ModelParallelImpl(torch::nn::Sequential sequential, std::vector<at::Device> devices,
                    ModelParallelOptions options = {});
  /// Explicit placement: every child's name mapped to its device.
  ModelParallelImpl(torch::nn::Sequential sequential, const std::map<std::string, at::Device>& placement,
                    ModelParallelOptions options = {});
  ~ModelParallelImpl() override;

  /// Runs the parts in order (see the file comment); the output is on the last part's device.
  at::Tensor forward(at::Tensor input);

  int64_t part_count() const { return static_cast<int64_t>(parts_.size()); }
  /// The children's names in part p, and its device.
  std::vector<std::string> part_names(int64_t part) const;
  const at::Device& part_device(int64_t part) const { return parts_.at(part).device; }
  const ModelParallelOptions& options() const { return options_; }

 private:
  struct Part {
    at::Device device{at::kCPU};
    std::vector<std::string> names;
    std::vector<torch::nn::AnyModule> modules;
  };
  void build(torch::nn::Sequential sequential, const std::vector<size_t>& child_parts,
             const std::vector<at::Device>& devices);
  at::Tensor run_part(size_t part, at::Tensor x);
  at::Tensor forward_micro_batches(const at::Tensor& input);

  ModelParallelOptions options_;
  std::vector<Part> parts_;
  std::unique_ptr<parallel::ReplicaThreads> threads_;
};

TORCH_MODULE(ModelParallel);

}  // namespace shoal::pipeline
