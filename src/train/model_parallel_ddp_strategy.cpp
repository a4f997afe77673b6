#include "shoal/train/model_parallel_ddp_strategy.h"

#include <torch/cuda.h>
#include <torch/torch.h>

#include "shoal/error.h"
#include "shoal/models/cnn.h"
#include "shoal/models/mlp.h"
#include "shoal/parallel/distributed_data_parallel.h"
#include "shoal/pipeline/model_parallel.h"
#include "shoal/train/trainer.h"

namespace shoal::train {

torch::nn::Sequential as_sequential(const std::shared_ptr<models::Model>& model) {
  using torch::nn::AnyModule;
  using torch::nn::NamedAnyModule;
  if (auto cnn = std::dynamic_pointer_cast<models::Cnn>(model)) {
    return torch::nn::Sequential({
        NamedAnyModule("conv1", cnn->conv1), NamedAnyModule("relu1", torch::nn::ReLU()),
        NamedAnyModule("conv2", cnn->conv2), NamedAnyModule("relu2", torch::nn::ReLU()),
        NamedAnyModule("pool", torch::nn::MaxPool2d(2)),
        NamedAnyModule("flatten", torch::nn::Flatten()), NamedAnyModule("fc1", cnn->fc1),
        NamedAnyModule("relu3", torch::nn::ReLU()), NamedAnyModule("fc2", cnn->fc2)});
  }
  if (auto mlp = std::dynamic_pointer_cast<models::Mlp>(model)) {
    return torch::nn::Sequential({
        NamedAnyModule("flatten", torch::nn::Flatten()), NamedAnyModule("fc1", mlp->fc1),
        NamedAnyModule("relu1", torch::nn::ReLU()), NamedAnyModule("fc2", mlp->fc2),
        NamedAnyModule("relu2", torch::nn::ReLU()), NamedAnyModule("fc3", mlp->fc3)});
  }
  SHOAL_THROW(InvalidArgument, "model parallel: no layer layout known for model ", model->name(),
              " (built-in: cnn, mlp)");
}

ModelParallelDdpStrategy::ModelParallelDdpStrategy(int parts, const comm::InitOptions& init)
    : DdpStrategy(init), parts_(parts) {
  SHOAL_CHECK_T(InvalidArgument, parts_ >= 1, "--model-parallel must be at least 1, got ", parts_);
}

ModelParallelDdpStrategy::ModelParallelDdpStrategy(int parts,
                                                   std::shared_ptr<comm::ProcessGroup> group)
    : DdpStrategy(std::move(group)), parts_(parts) {
  SHOAL_CHECK_T(InvalidArgument, parts_ >= 1, "--model-parallel must be at least 1, got ", parts_);
}

ModelParallelDdpStrategy::~ModelParallelDdpStrategy() = default;

void ModelParallelDdpStrategy::prepare(TrainState& state) {
  std::vector<at::Device> devices;
  const bool cuda = torch::cuda::is_available() &&
                    static_cast<int>(torch::cuda::device_count()) >= parts_;
  for (int p = 0; p < parts_; ++p) {
    if (cuda) {
      const int index = (rank() * parts_ + p) % static_cast<int>(torch::cuda::device_count());
      devices.emplace_back(at::kCUDA, static_cast<c10::DeviceIndex>(index));
    } else {
      devices.emplace_back(at::kCPU);
    }
  }
  pipeline::ModelParallel split(as_sequential(state.model), devices,
                                pipeline::ModelParallelOptions().chunks(parts_));
  auto ddp = std::make_shared<parallel::DistributedDataParallel<pipeline::ModelParallelImpl>>(
      split.ptr(), std::shared_ptr<comm::ProcessGroup>(process_group(), [](comm::ProcessGroup*) {}));
  ddp_ = ddp;
  const at::Device input_device = devices.front();
  state.forward = [ddp, input_device](const at::Tensor& input) {
    return ddp->forward(input.to(input_device));
  };
}

}  // namespace shoal::train
