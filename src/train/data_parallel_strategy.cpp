#include "shoal/train/data_parallel_strategy.h"

#include "shoal/error.h"
#include "shoal/models/registry.h"
#include "shoal/parallel/data_parallel.h"
#include "shoal/train/trainer.h"

namespace shoal::train {

DataParallelStrategy::DataParallelStrategy(int replicas, std::string model_name)
    : replicas_(replicas), model_name_(std::move(model_name)) {
  SHOAL_CHECK_T(InvalidArgument, replicas_ >= 1, "--replicas must be at least 1, got ", replicas_);
}

DataParallelStrategy::~DataParallelStrategy() = default;

void DataParallelStrategy::prepare(TrainState& state) {
  // The replicas' forwards run on threads of their own, where this thread's autocast is off.
  SHOAL_CHECK_T(InvalidArgument, !state.autocast_dtype,
                "--precision ", *state.autocast_dtype == at::kHalf ? "fp16" : "bf16",
                " is not supported with --strategy dp yet; use single, ddp or ps");
  std::vector<int64_t> ids;
  for (int i = 0; i < replicas_; ++i) ids.push_back(i);
  const std::string name = model_name_;
  // Replicas only need the model's structure: their parameters share the model's storage.
  auto model = std::dynamic_pointer_cast<models::Model>(state.model);
  SHOAL_CHECK_T(InvalidArgument, model != nullptr,
                "--strategy dp replicates the built-in models (mlp, cnn); wrap your own module in "
                "parallel::DataParallel directly");
  auto dp = std::make_shared<parallel::DataParallel<models::Model>>(
      model, parallel::DataParallelOptions().device_ids(ids),
      [name, shape = model->input_shape()] { return models::create(name, /*seed=*/0, shape); });
  dp_ = dp;
  state.forward = [dp](const at::Tensor& input) { return dp->forward(input); };
}

}  // namespace shoal::train
