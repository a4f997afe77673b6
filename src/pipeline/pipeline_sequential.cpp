#include "shoal/pipeline/pipeline_sequential.h"

#include <torch/torch.h>

#include "shoal/error.h"
#include "shoal/models/cnn.h"
#include "shoal/models/mlp.h"

namespace shoal::pipeline {

torch::nn::Sequential as_sequential(models::Model& model) {
  torch::nn::Sequential seq;
  if (auto* mlp = dynamic_cast<models::Mlp*>(&model)) {
    seq->push_back("flatten", torch::nn::Flatten());
    seq->push_back("fc1", mlp->fc1);
    seq->push_back("relu1", torch::nn::ReLU());
    seq->push_back("fc2", mlp->fc2);
    seq->push_back("relu2", torch::nn::ReLU());
    seq->push_back("fc3", mlp->fc3);
    return seq;
  }
  if (auto* cnn = dynamic_cast<models::Cnn*>(&model)) {
    seq->push_back("conv1", cnn->conv1);
    seq->push_back("relu1", torch::nn::ReLU());
    seq->push_back("conv2", cnn->conv2);
    seq->push_back("relu2", torch::nn::ReLU());
    seq->push_back("pool", torch::nn::MaxPool2d(torch::nn::MaxPool2dOptions(2)));
    seq->push_back("flatten", torch::nn::Flatten());
    seq->push_back("fc1", cnn->fc1);
    seq->push_back("relu3", torch::nn::ReLU());
    seq->push_back("fc2", cnn->fc2);
    return seq;
  }
  SHOAL_THROW(InvalidArgument, "as_sequential: ", model.name(),
              " is not a built-in model with a sequential form (mlp, cnn); a TorchScript model is "
              "not split into stages yet (its forward is one compiled graph): train it with "
              "--strategy single, ddp, dp or ps");
}

}  // namespace shoal::pipeline
