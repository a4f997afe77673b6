#include "shoal/models/cnn.h"

#include "shoal/error.h"

namespace shoal::models {

Cnn::Cnn(const InputShape& shape) {
  SHOAL_CHECK_T(InvalidArgument, shape.channels >= 1 && shape.height >= 6 && shape.width >= 6 &&
                                     shape.num_classes >= 1,
                "the cnn model needs images of at least 1 x 6 x 6 and one class; got ",
                shape.channels, " x ", shape.height, " x ", shape.width, ", ", shape.num_classes,
                " classes");
  input_shape_ = shape;
  // Registration order = PyTorch attribute order: the parameters come out in the same sequence.
  conv1 = register_module("conv1",
                          torch::nn::Conv2d(torch::nn::Conv2dOptions(shape.channels, 32, 3)));
  conv2 = register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(32, 64, 3)));
  // Two unpadded 3x3 convolutions take 4 rows and columns, the 2x2 pool halves what is left.
  const int64_t features = 64 * ((shape.height - 4) / 2) * ((shape.width - 4) / 2);
  fc1 = register_module("fc1", torch::nn::Linear(features, 128));
  fc2 = register_module("fc2", torch::nn::Linear(128, shape.num_classes));
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
