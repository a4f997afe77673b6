#include "shoal/models/model.h"

#include <torch/nn/modules/container/sequential.h>

#include "shoal/error.h"
#include "shoal/parallel/tensor_parallel.h"

namespace shoal::models {

at::Tensor Model::forward_loss(const at::Tensor&, const at::Tensor&) {
  SHOAL_THROW(InvalidArgument, "the model ", name(),
              " does not compute its own loss; apply a loss to its forward's output");
}

torch::nn::Sequential Model::as_sequential() {
  SHOAL_THROW(InvalidArgument, "as_sequential: ", name(),
              " is not a built-in model with a sequential form (mlp, cnn, gpt)");
}

std::shared_ptr<Model> Model::copy() const {
  SHOAL_THROW(InvalidArgument, "the model ", name(), " cannot be copied by the trainer");
}

parallel::TensorParallelLayout Model::parallelize(std::shared_ptr<comm::ProcessGroup>) {
  SHOAL_THROW(InvalidArgument, "the model ", name(),
              " has no tensor-parallel plan; --mesh splits --model gpt");
}

torch::nn::Sequential Model::copy_of(torch::nn::Sequential& layers) {
  torch::nn::Sequential copy;
  const auto names = layers->named_children().keys();
  size_t i = 0;
  for (auto& layer : *layers) copy->push_back(names.at(i++), layer);
  return copy;
}

}  // namespace shoal::models
