#include "shoal/pipeline/pipeline_sequential.h"

#include <torch/nn/modules/container/sequential.h>

namespace shoal::pipeline {

torch::nn::Sequential as_sequential(models::Model& model) { return model.as_sequential(); }

}  // namespace shoal::pipeline
