// A multilayer perceptron 784-1024-1024-10 with ReLU: few FLOPs per byte of parameters, so it is
// the model that stresses gradient communication most (3.8 M parameters, 15 MB of gradients).
//
// Submodules are registered as fc1, fc2, fc3, in the order of the equivalent PyTorch module, so
// parameter names are "fc1.weight", "fc1.bias", ...
//
// Thread safety: that of torch::nn::Module (see model.h).
#pragma once

#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include "shoal/models/model.h"

namespace shoal::models {

/// flatten-fc(784,1024)-relu-fc(1024,1024)-relu-fc(1024,10).
class Mlp : public Model {
 public:
  Mlp() : Mlp(InputShape{}) {}
  /// fc(C*H*W, 1024), fc(1024, 1024), fc(1024, classes).
  explicit Mlp(const InputShape& shape);
  /// [B,1,28,28] (or [B,784]) -> logits [B,10].
  at::Tensor forward(at::Tensor input) override;
  /// The layers forward() runs, in its order (the registered modules and the steps between them).
  torch::nn::Sequential as_sequential() override { return copy_of(layers_); }

  torch::nn::Linear fc1{nullptr};
  torch::nn::Linear fc2{nullptr};
  torch::nn::Linear fc3{nullptr};

 private:
  // forward() and as_sequential() both read this one list, so a pipeline's stages compute what
  // the model does. Not registered: it holds the registered layers, whose names stay the
  // PyTorch module's.
  torch::nn::Sequential layers_;
};

}  // namespace shoal::models
