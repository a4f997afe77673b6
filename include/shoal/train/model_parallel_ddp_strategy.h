// ModelParallelDdpStrategy: `shoal train --strategy ddp --model-parallel K`, PyTorch's "DDP with
// model parallel": each rank holds the model split into K consecutive parts (ModelParallel, K
// micro-batches flowing through the parts on one thread each; the parts are CPU "devices", or
// GPUs local_rank*K .. local_rank*K+K-1 with CUDA) and wraps the split model in
// DistributedDataParallel (no device_ids: the module spans devices). Data, metrics and
// checkpoints are DdpStrategy's: the split model shares the built-in model's layers, so its
// parameters and state dict names are the model's own.
//
// The built-in models are not Sequentials; their layers are laid out as one here (cnn: conv1,
// relu, conv2, relu, max_pool, flatten, fc1, relu, fc2; mlp: flatten, fc1, relu, fc2, relu, fc3),
// which is exactly their forward.
//
// Thread safety: as Strategy.
#pragma once

#include <memory>

#include "shoal/train/ddp_strategy.h"

namespace shoal::parallel {
class DistributedDataParallelBase;
}

namespace shoal::models {
class Model;
}

namespace torch::nn {
class Sequential;
}

namespace shoal::train {

class ModelParallelDdpStrategy : public DdpStrategy {
 public:
  ModelParallelDdpStrategy(int parts, const comm::InitOptions& init = {});
  ModelParallelDdpStrategy(int parts, std::shared_ptr<comm::ProcessGroup> group);
  ~ModelParallelDdpStrategy() override;

  void prepare(TrainState& state) override;
  /// Its parts are placed on the CPU.
  bool trains_on_gpu() const override { return false; }

 private:
  int parts_;
  std::shared_ptr<parallel::DistributedDataParallelBase> ddp_;
};

}  // namespace shoal::train
