#include "shoal/models/cnn.h"

namespace shoal::models {

Cnn::Cnn() {
  // Registration order = PyTorch attribute order: the parameters come out in the same sequence.
  conv1 = register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 32, 3)));
  conv2 = register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(32, 64, 3)));
  fc1 = register_module("fc1", torch::nn::Linear(9216, 128));
  fc2 = register_module("fc2", torch::nn::Linear(128, 10));
}

at::Tensor Cnn::forward(at::Tensor input) {
  at::Tensor x = torch::relu(conv1->forward(input));
  x = torch::relu(conv2->forward(x));
  x = torch::max_pool2d(x, 2);
  x = torch::flatten(x, 1);
  x = torch::relu(fc1->forward(x));
  return fc2->forward(x);
}

}  // namespace shoal::models
