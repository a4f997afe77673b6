#include "shoal/models/mlp.h"

#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/linear.h>

#include "shoal/error.h"

namespace shoal::models {

Mlp::Mlp(const InputShape& shape) {
  SHOAL_CHECK_T(InvalidArgument, shape.channels * shape.height * shape.width >= 1 &&
                                     shape.num_classes >= 1,
                "the mlp model needs at least one input feature and one class");
  input_shape_ = shape;
  fc1 = register_module("fc1",
                        torch::nn::Linear(shape.channels * shape.height * shape.width, 1024));
  fc2 = register_module("fc2", torch::nn::Linear(1024, 1024));
  fc3 = register_module("fc3", torch::nn::Linear(1024, shape.num_classes));
  layers_->push_back("flatten", torch::nn::Flatten());
  layers_->push_back("fc1", fc1);
  layers_->push_back("relu1", torch::nn::ReLU());
  layers_->push_back("fc2", fc2);
  layers_->push_back("relu2", torch::nn::ReLU());
  layers_->push_back("fc3", fc3);
}

at::Tensor Mlp::forward(at::Tensor input) { return layers_->forward(input); }

}  // namespace shoal::models
