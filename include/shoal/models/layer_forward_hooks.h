// LayerForwardHooks: what stands in for PyTorch's forward hooks on a module's layers. LibTorch
// modules have none, so a model whose layers tensor parallelism may split (parallel/
// tensor_parallel.h) calls those layers through call_layer, where a hook can replace their
// forward (and put its collectives around it).
//
// Thread safety: set hooks before training; call_layer only reads them.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <functional>
#include <string>
#include <vector>

namespace shoal::models {

/// A replacement for a layer's forward, given the layer (which holds its parameters) and its input.
using LayerForward = std::function<at::Tensor(torch::nn::Module& layer, const at::Tensor& input)>;

/// A module whose forward runs a LayerForward in place of some of its layers' own forward once one
/// is set: what stands in for PyTorch's forward hooks on those layers.
class LayerForwardHooks {
 public:
  virtual ~LayerForwardHooks() = default;
  /// The layers (paths below this module, e.g. "c_attn", "transformer.wte") a hook can replace.
  const std::vector<std::string>& hookable_layers() const { return layers_; }
  /// From now on runs `forward` in place of the forward of `layer` (one of hookable_layers(),
  /// else InvalidArgument).
  void set_layer_forward(const std::string& layer, LayerForward forward);

 protected:
  explicit LayerForwardHooks(std::vector<std::string> layers);
  /// The hook of hookable_layers()[index] on `input` where one is set, else own(input).
  template <typename Own>
  at::Tensor call_layer(size_t index, torch::nn::Module& layer, const at::Tensor& input,
                        Own&& own) {
    return forwards_[index] ? forwards_[index](layer, input) : own(input);
  }

 private:
  std::vector<std::string> layers_;
  std::vector<LayerForward> forwards_;
};

}  // namespace shoal::models
