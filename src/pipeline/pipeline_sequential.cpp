#include "shoal/pipeline/pipeline_sequential.h"

#include <torch/script.h>
#include <torch/torch.h>

#include "shoal/error.h"
#include "shoal/models/cnn.h"
#include "shoal/models/mlp.h"
#include "shoal/models/script_model.h"

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
  if (auto* script = dynamic_cast<models::ScriptModel*>(&model)) {
    // A scripted torch.nn.Sequential runs its children one after another: each child is a stage
    // candidate, wrapped as a ScriptModel that shares its tensors (names "0.weight", ... as in
    // Python). Any other script module's forward is one compiled graph that cannot be cut.
    torch::jit::Module& module = script->script_module();
    const auto type_name = module.type()->name();
    const std::string type = type_name ? type_name->qualifiedName() : std::string("(unnamed)");
    SHOAL_CHECK_T(InvalidArgument,
                  type.find("torch.nn.modules.container.Sequential") != std::string::npos,
                  "a TorchScript model splits into pipeline stages only when it is a "
                  "torch.nn.Sequential (its children run one after another); this one is ", type,
                  ", whose forward is one compiled graph: train it with --strategy single, ddp, "
                  "fsdp, dp or ps, or script an nn.Sequential of its layers");
    for (const auto& child : module.named_children()) {
      seq->push_back(child.name, std::make_shared<models::ScriptModel>(child.value));
    }
    return seq;
  }
  SHOAL_THROW(InvalidArgument, "as_sequential: ", model.name(),
              " is not a built-in model with a sequential form (mlp, cnn)");
}

}  // namespace shoal::pipeline
