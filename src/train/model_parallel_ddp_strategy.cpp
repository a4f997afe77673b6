#include "shoal/train/model_parallel_ddp_strategy.h"

#include <torch/cuda.h>
#include <torch/torch.h>

#include "shoal/error.h"
#include "shoal/parallel/distributed_data_parallel.h"
#include "shoal/pipeline/model_parallel.h"
#include "shoal/pipeline/pipeline_sequential.h"
#include "shoal/train/trainer.h"

namespace shoal::train {

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
  auto* model = dynamic_cast<models::Model*>(state.model.get());
  SHOAL_CHECK_T(InvalidArgument, model != nullptr,
                "--model-parallel splits the built-in models (mlp, cnn); for your own module build "
                "a pipeline::ModelParallel over a torch::nn::Sequential");
  // The model's own layers, in order, as a Sequential (the same layout the pipeline splits).
  pipeline::ModelParallel split(pipeline::as_sequential(*model), devices,
                                pipeline::ModelParallelOptions().chunks(parts_));
  auto ddp = std::make_shared<parallel::DistributedDataParallel<pipeline::ModelParallelImpl>>(
      split.ptr(), std::shared_ptr<comm::ProcessGroup>(process_group(), [](comm::ProcessGroup*) {}));
  ddp_ = ddp;
  set_comm_stats_source(ddp);
  const at::Device input_device = devices.front();
  state.forward = [ddp, input_device](const at::Tensor& input) {
    return ddp->forward(input.to(input_device));
  };
}

}  // namespace shoal::train
