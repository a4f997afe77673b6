#include "shoal/models/script_model.h"

#include <torch/script.h>

#include "checkpoint/script_archive.h"
#include "shoal/error.h"

namespace shoal::models {
namespace {

/// Registers `script`'s own parameters and buffers in `into`, then a mirror of each child.
void mirror(const torch::jit::Module& script, torch::nn::Module& into) {
  for (const auto& item : script.named_parameters(/*recurse=*/false)) {
    into.register_parameter(item.name, item.value, item.value.requires_grad());
  }
  for (const auto& item : script.named_buffers(/*recurse=*/false)) {
    into.register_buffer(item.name, item.value);
  }
  for (const auto& child : script.named_children()) {
    auto holder = std::make_shared<torch::nn::Module>(child.name);
    mirror(child.value, *holder);
    into.register_module(child.name, holder);
  }
}

bool ends_with(const std::string& text, const std::string& tail) {
  return text.size() >= tail.size() && text.compare(text.size() - tail.size(), tail.size(), tail) == 0;
}

}  // namespace

ScriptModel::ScriptModel(const torch::jit::Module& module)
    : module_(std::make_unique<torch::jit::Module>(module)) {
  mirror(*module_, *this);
  Model::train(module_->is_training());
}

ScriptModel::~ScriptModel() = default;

std::shared_ptr<ScriptModel> ScriptModel::load(const std::string& path) {
  try {
    checkpoint::detail::check_script_archive(path);
  } catch (const CheckpointError& e) {
    throw InvalidArgument(e.what(), e.location());
  }
  torch::jit::Module module;
  try {
    module = torch::jit::load(path, c10::Device(c10::kCPU));
  } catch (const c10::Error& e) {
    // LibTorch's message runs over many lines (a C++ stack): its first says what went wrong.
    std::string first = e.what_without_backtrace();
    first = first.substr(0, first.find('\n'));
    SHOAL_THROW(InvalidArgument, path, ": not a TorchScript model (save one from Python with "
                "torch.jit.script(model).save(path)): ", first);
  }
  SHOAL_CHECK_T(InvalidArgument, module.find_method("forward").has_value(), path,
                ": the TorchScript module has no forward method");
  return std::make_shared<ScriptModel>(module);
}

at::Tensor ScriptModel::forward(at::Tensor input) {
  const c10::IValue output = module_->forward({std::move(input)});
  SHOAL_CHECK_T(InvalidArgument, output.isTensor(), "the TorchScript model's forward returned a ",
                output.tagKind(), "; the trainer needs one tensor (the logits)");
  return output.toTensor();
}

void ScriptModel::train(bool on) {
  Model::train(on);
  module_->train(on);
}

std::shared_ptr<ScriptModel> ScriptModel::clone_module() const {
  return std::make_shared<ScriptModel>(module_->clone());
}

torch::jit::Module& ScriptModel::script_module() { return *module_; }

bool is_script_path(const std::string& name) {
  return ends_with(name, ".pt") || ends_with(name, ".pth") || ends_with(name, ".ts") ||
         name.find('/') != std::string::npos;
}

}  // namespace shoal::models
