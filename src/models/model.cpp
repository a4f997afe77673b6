#include "shoal/models/model.h"

#include "shoal/error.h"

namespace shoal::models {

at::Tensor Model::forward_loss(const at::Tensor&, const at::Tensor&) {
  SHOAL_THROW(InvalidArgument, "the model ", name(),
              " does not compute its own loss; apply a loss to its forward's output");
}

}  // namespace shoal::models
