#include "shoal/models/cnn.h"

#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/pooling.h>

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
  layers_->push_back("conv1", conv1);
  layers_->push_back("relu1", torch::nn::ReLU());
  layers_->push_back("conv2", conv2);
  layers_->push_back("relu2", torch::nn::ReLU());
  layers_->push_back("pool", torch::nn::MaxPool2d(torch::nn::MaxPool2dOptions(2)));
  layers_->push_back("flatten", torch::nn::Flatten());
  layers_->push_back("fc1", fc1);
  layers_->push_back("relu3", torch::nn::ReLU());
  layers_->push_back("fc2", fc2);
}

at::Tensor Cnn::forward(at::Tensor input) { return layers_->forward(input); }

}  // namespace shoal::models
