#include "shoal/models/script_model.h"

#include <torch/nn/modules/container/sequential.h>
#include <torch/script.h>

#include <algorithm>
#include <optional>
#include <vector>

#include "checkpoint/script_archive.h"
#include "shoal/error.h"
#include "shoal/log.h"

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

std::string trim_blanks(const std::string& text) {
  const size_t begin = text.find_first_not_of(" \t");
  if (begin == std::string::npos) return "";
  return text.substr(begin, text.find_last_not_of(" \t") - begin + 1);
}

/// One line out of a TorchScript interpreter error: the error itself (its last line), and where
/// the innermost "<--- HERE" of the traceback points (the operation that failed, its file and
/// line). A message without a traceback gives its first line.
std::string summarize_script_error(const std::string& text) {
  std::vector<std::string> lines;
  for (size_t begin = 0; begin < text.size();) {
    const size_t end = std::min(text.find('\n', begin), text.size());
    if (!trim_blanks(text.substr(begin, end - begin)).empty()) lines.push_back(text.substr(begin, end - begin));
    begin = end + 1;
  }
  if (lines.empty()) return "(no message)";
  size_t here = lines.size();
  for (size_t i = 0; i < lines.size(); ++i) {
    if (lines[i].find("<--- HERE") != std::string::npos && i > 0) here = i;
  }
  if (here == lines.size()) return trim_blanks(lines.front());
  std::string where;
  for (size_t i = here; i-- > 0;) {
    const std::string line = trim_blanks(lines[i]);
    if (line.rfind("File \"", 0) == 0) {
      where = " (" + line.substr(5) + ")";  // "code/__torch__.py", line 11, in forward
      break;
    }
  }
  return "at `" + trim_blanks(lines[here - 1]) + "`" + where + ": " + trim_blanks(lines.back());
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

/// `module`'s forward on `inputs`; a throw becomes one line naming `path`.
c10::IValue run_forward(torch::jit::Module& module, const std::string& path,
                        std::vector<c10::IValue> inputs) {
  try {
    return module.forward(std::move(inputs));
  } catch (const std::exception& e) {
    // The interpreter's message is a traceback of the script's code and of the Python it came
    // from, 20 to 40 lines: one says what failed; the whole is there at debug level.
    const auto* error = dynamic_cast<const c10::Error*>(&e);
    const std::string text = error ? error->what_without_backtrace() : e.what();
    log::debug("shoal: ", path, ": the model's forward failed:\n", text);
    SHOAL_THROW(InvalidArgument, path, ": the model's forward failed ", summarize_script_error(text),
                " (SHOAL_LOG_LEVEL=debug shows the TorchScript traceback)");
  }
}

}  // namespace

ScriptModel::ScriptModel(const torch::jit::Module& module, std::string path)
    : module_(std::make_unique<torch::jit::Module>(module)), path_(std::move(path)) {
  mirror(*module_, *this);
  Model::train(module_->is_training());
  // forward(self, inputs, targets): the model computes its own loss.
  owns_loss_ = module_->get_method("forward").function().getSchema().arguments().size() == 3;
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
  return std::make_shared<ScriptModel>(module, path);
}

at::Tensor ScriptModel::forward(at::Tensor input) {
  const c10::IValue output = run_forward(*module_, path_, {std::move(input)});
  SHOAL_CHECK_T(InvalidArgument, output.isTensor(), path_, ": the TorchScript model's forward "
                "returned a ", output.tagKind(), "; the trainer needs one tensor (the logits)");
  return output.toTensor();
}

at::Tensor ScriptModel::forward_loss(const at::Tensor& inputs, const at::Tensor& targets) {
  SHOAL_CHECK_T(InvalidArgument, owns_loss_, path_, ": the TorchScript model's forward takes "
                "one input; it does not compute its own loss");
  const c10::IValue output = run_forward(*module_, path_, {inputs, targets});
  const std::optional<at::Tensor> loss = loss_in(output);
  SHOAL_CHECK_T(InvalidArgument, loss.has_value(), path_,
                ": forward(inputs, targets) returned a ", output.tagKind(),
                ", neither a tensor nor a dict with 'loss'; a model that computes its own loss "
                "returns the loss or {'loss': loss, ...}");
  SHOAL_CHECK_T(InvalidArgument, loss->numel() == 1, path_, ": forward(inputs, targets) returned "
                "a loss of shape ", loss->sizes(), "; the loss is one value (reduce it, e.g. "
                ".mean())");
  return *loss;
}

void ScriptModel::train(bool on) {
  Model::train(on);
  module_->train(on);
}

std::shared_ptr<ScriptModel> ScriptModel::clone_module() const {
  return std::make_shared<ScriptModel>(module_->clone(), path_);
}

torch::jit::Module& ScriptModel::script_module() { return *module_; }

torch::nn::Sequential ScriptModel::as_sequential() {
  // A scripted torch.nn.Sequential runs its children one after another: each child is a stage
  // candidate, wrapped as a ScriptModel that shares its tensors (names "0.weight", ... as in
  // Python). Any other script module's forward is one compiled graph that cannot be cut.
  const auto type_name = module_->type()->name();
  const std::string type = type_name ? type_name->qualifiedName() : std::string("(unnamed)");
  SHOAL_CHECK_T(InvalidArgument,
                type.find("torch.nn.modules.container.Sequential") != std::string::npos,
                "a TorchScript model splits into pipeline stages only when it is a "
                "torch.nn.Sequential (its children run one after another); this one is ", type,
                ", whose forward is one compiled graph: train it with --strategy single, ddp, "
                "fsdp, dp or ps, or script an nn.Sequential of its layers");
  torch::nn::Sequential seq;
  for (const auto& child : module_->named_children()) {
    seq->push_back(child.name, std::make_shared<ScriptModel>(child.value));
  }
  return seq;
}

bool is_script_path(const std::string& name) {
  return ends_with(name, ".pt") || ends_with(name, ".pth") || ends_with(name, ".ts") ||
         name.find('/') != std::string::npos;
}

}  // namespace shoal::models
