#include "shoal/models/script_model.h"

#include <torch/script.h>

#include <optional>

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

/// The loss in what forward(inputs, targets) returned: a tensor, or a dict's "loss".
std::optional<at::Tensor> loss_in(const c10::IValue& output) {
  if (output.isTensor()) return output.toTensor();
  if (!output.isGenericDict()) return std::nullopt;
  for (const auto& entry : output.toGenericDict()) {
    if (entry.key().isString() && entry.key().toStringRef() == "loss" && entry.value().isTensor()) {
      return entry.value().toTensor();
    }
  }
  return std::nullopt;
}

}  // namespace

ScriptModel::ScriptModel(const torch::jit::Module& module, std::string source)
    : module_(std::make_unique<torch::jit::Module>(module)), source_(std::move(source)) {
  mirror(*module_, *this);
  Model::train(module_->is_training());
  // forward(self, inputs, targets): the model computes its own loss.
  owns_loss_ = module_->get_method("forward").function().getSchema().arguments().size() == 3;
}

ScriptModel::~ScriptModel() = default;

std::shared_ptr<ScriptModel> ScriptModel::load(const std::string& path) {
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
  return std::make_shared<ScriptModel>(module, path);
}

at::Tensor ScriptModel::forward(at::Tensor input) {
  const c10::IValue output = module_->forward({std::move(input)});
  SHOAL_CHECK_T(InvalidArgument, output.isTensor(), source_, ": the TorchScript model's forward "
                "returned a ", output.tagKind(), "; the trainer needs one tensor (the logits)");
  return output.toTensor();
}

at::Tensor ScriptModel::forward_loss(const at::Tensor& inputs, const at::Tensor& targets) {
  SHOAL_CHECK_T(InvalidArgument, owns_loss_, source_, ": the TorchScript model's forward takes "
                "one input; it does not compute its own loss");
  const c10::IValue output = module_->forward({inputs, targets});
  const std::optional<at::Tensor> loss = loss_in(output);
  SHOAL_CHECK_T(InvalidArgument, loss.has_value(), source_,
                ": forward(inputs, targets) returned a ", output.tagKind(),
                ", neither a tensor nor a dict with 'loss'; a model that computes its own loss "
                "returns the loss or {'loss': loss, ...}");
  SHOAL_CHECK_T(InvalidArgument, loss->numel() == 1, source_, ": forward(inputs, targets) returned "
                "a loss of shape ", loss->sizes(), "; the loss is one value (reduce it, e.g. "
                ".mean())");
  return *loss;
}

void ScriptModel::train(bool on) {
  Model::train(on);
  module_->train(on);
}

std::shared_ptr<ScriptModel> ScriptModel::clone_module() const {
  return std::make_shared<ScriptModel>(module_->clone(), source_);
}

torch::jit::Module& ScriptModel::script_module() { return *module_; }

bool is_script_path(const std::string& name) {
  return ends_with(name, ".pt") || ends_with(name, ".pth") || ends_with(name, ".ts") ||
         name.find('/') != std::string::npos;
}

}  // namespace shoal::models
