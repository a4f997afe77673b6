#include "shoal/models/mlp.h"

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
}

at::Tensor Mlp::forward(at::Tensor input) {
  at::Tensor x = torch::flatten(input, 1);
  x = torch::relu(fc1->forward(x));
  x = torch::relu(fc2->forward(x));
  return fc3->forward(x);
}

}  // namespace shoal::models
