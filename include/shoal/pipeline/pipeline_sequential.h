// A model as a torch::nn::Sequential that pipelines can partition: Model::as_sequential(), which
// each model implements (the built-in mlp, cnn and gpt, a scripted nn.Sequential): the same layer
// objects (no copy), under the same names (fc1, conv1, ...), with the functional steps of their
// forward (relu, max-pool, flatten) as parameter-free layers between them. The Sequential computes
// what the model computes; the mlp's and cnn's state dict has the model's keys, the GPT's groups
// its modules under other names (embeddings, h_0, ..., head): checkpoints are of the model.
//
// Thread safety: as torch::nn::Module.
#pragma once

#include <torch/nn/modules/container/sequential.h>

#include "shoal/models/model.h"

namespace shoal::pipeline {

/// model.as_sequential(); throws InvalidArgument for a model that is not a chain of layers.
torch::nn::Sequential as_sequential(models::Model& model);

}  // namespace shoal::pipeline
