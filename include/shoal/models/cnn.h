// The classic two-convolution CNN of PyTorch's MNIST example, without dropout (deterministic).
//
//   conv1 1->32 k3, relu, conv2 32->64 k3, relu, maxpool 2, flatten, fc1 9216->128, relu,
//   fc2 128->10
//
// Submodules are registered in the order, and under the names, of the equivalent PyTorch module
// (conv1, conv2, fc1, fc2), so parameters are "conv1.weight", "conv1.bias", ... and a state dict
// moves between this and Python unchanged; constructed right after torch.manual_seed(s) in both,
// the initial weights are equal too.
//
// Thread safety: that of torch::nn::Module (see model.h).
#pragma once

#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include "shoal/models/model.h"

namespace shoal::models {

/// conv(1,32,3)-relu-conv(32,64,3)-relu-maxpool(2)-fc(9216,128)-relu-fc(128,10).
class Cnn : public Model {
 public:
  Cnn() : Cnn(InputShape{}) {}
  /// For other images: conv(C,32,3), conv(32,64,3), fc(64 * ((H-4)/2) * ((W-4)/2), 128),
  /// fc(128, classes). Throws InvalidArgument for images smaller than 6 x 6.
  explicit Cnn(const InputShape& shape);
  /// [B,1,28,28] -> logits [B,10] (by default).
  at::Tensor forward(at::Tensor input) override;
  /// The layers forward() runs, in its order (the registered modules and the steps between them).
  torch::nn::Sequential as_sequential() override { return copy_of(layers_); }

  torch::nn::Conv2d conv1{nullptr};
  torch::nn::Conv2d conv2{nullptr};
  torch::nn::Linear fc1{nullptr};
  torch::nn::Linear fc2{nullptr};

 private:
  // forward() and as_sequential() both read this one list, so a pipeline's stages compute what
  // the model does. Not registered: it holds the registered layers, whose names stay the
  // PyTorch module's.
  torch::nn::Sequential layers_;
};

}  // namespace shoal::models
