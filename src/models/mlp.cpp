#include "shoal/models/mlp.h"

namespace shoal::models {

Mlp::Mlp() {
  fc1 = register_module("fc1", torch::nn::Linear(784, 1024));
  fc2 = register_module("fc2", torch::nn::Linear(1024, 1024));
  fc3 = register_module("fc3", torch::nn::Linear(1024, 10));
}

at::Tensor Mlp::forward(at::Tensor input) {
  at::Tensor x = torch::flatten(input, 1);
  x = torch::relu(fc1->forward(x));
  x = torch::relu(fc2->forward(x));
  return fc3->forward(x);
}

}  // namespace shoal::models
