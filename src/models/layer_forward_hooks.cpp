#include "shoal/models/layer_forward_hooks.h"

#include "shoal/error.h"

namespace shoal::models {

LayerForwardHooks::LayerForwardHooks(std::vector<std::string> layers)
    : layers_(std::move(layers)), forwards_(layers_.size()) {}

void LayerForwardHooks::set_layer_forward(const std::string& layer, LayerForward forward) {
  for (size_t i = 0; i < layers_.size(); ++i) {
    if (layers_[i] == layer) {
      forwards_[i] = std::move(forward);
      return;
    }
  }
  SHOAL_THROW(InvalidArgument, "no forward hook for layer '", layer, "' in this module");
}

}  // namespace shoal::models
