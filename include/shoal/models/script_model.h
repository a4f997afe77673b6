// A TorchScript module (saved from Python with torch.jit.script(model).save(path), or
// torch.jit.trace) as a shoal::models::Model, so that everything that trains a torch::nn::Module
// (the Trainer, DistributedDataParallel, DataParallel, the parameter server, checkpoints) trains it.
//
// The adapter mirrors the script module's tree: one torch::nn::Module per submodule, registered
// under the submodule's name, holding the very tensors of the script module's parameters and
// buffers (not copies). named_parameters() and state dicts therefore carry Python's names
// ("block.conv1.weight", "bn.running_mean", ...), an optimizer's in-place updates and DDP's
// broadcasts change the script module's weights, and a state dict saved from it loads into the
// original Python nn.Module with load_state_dict. forward() runs the script module's forward;
// train()/eval() switch its mode too (dropout, BatchNorm). Pipeline and --model-parallel split a
// scripted torch.nn.Sequential into its children (as_sequential) and refuse any other
// script module in one line: its forward is one compiled graph.
//
// A script module whose forward takes two tensors, forward(inputs, targets), computes its own
// loss (owns_loss): it returns the loss tensor, or a dict with "loss" (and any metrics, which the
// trainer does not use), as Hugging Face's models and nanoGPT's GPT.forward(idx, targets) do.
//
// Thread safety: that of torch::nn::Module (see model.h); clone_module() gives a replica with
// tensors of its own.
#pragma once

#include <memory>
#include <string>

#include "shoal/models/model.h"

namespace torch::jit {
struct Module;
}

namespace shoal::models {

class ScriptModel : public Model {
 public:
  /// Wraps `module` (shared: the adapter and `module` see the same tensors); `path`, the file it
  /// came from, names it in errors.
  explicit ScriptModel(const torch::jit::Module& module, std::string path = "the TorchScript model");
  ~ScriptModel() override;

  /// torch::jit::load(path) on the CPU, wrapped. Throws InvalidArgument with one line naming the
  /// file when it is missing or not a TorchScript archive.
  static std::shared_ptr<ScriptModel> load(const std::string& path);

  /// The script module's forward on one tensor; it must return one tensor. When the script
  /// throws, throws InvalidArgument in one line naming the file, the operation that failed and
  /// the error; the interpreter's whole traceback goes to the debug log.
  at::Tensor forward(at::Tensor input) override;
  /// A scripted torch.nn.Sequential's children, each wrapped as a ScriptModel sharing its
  /// tensors; any other script module throws InvalidArgument (its forward is one compiled graph).
  torch::nn::Sequential as_sequential() override;
  /// True when the script module's forward takes two tensors (inputs, targets).
  bool owns_loss() const override { return owns_loss_; }
  /// forward(inputs, targets)'s loss: the tensor it returns, or its dict's "loss". Anything else,
  /// or a loss of more than one value, throws InvalidArgument naming the file.
  at::Tensor forward_loss(const at::Tensor& inputs, const at::Tensor& targets) override;
  /// The file the model was loaded from (or what the constructor was given).
  const std::string& path() const { return path_; }
  /// Sets training mode on the adapter and on the script module (all its submodules).
  void train(bool on = true) override;
  /// A deep copy (torch::jit::Module::clone: tensors of its own), wrapped: a replica for
  /// DataParallel.
  std::shared_ptr<ScriptModel> clone_module() const;
  /// The wrapped script module.
  torch::jit::Module& script_module();

 private:
  std::unique_ptr<torch::jit::Module> module_;
  std::string path_;
  bool owns_loss_ = false;
};

/// True when `name` names a TorchScript file rather than a built-in model: it ends in .pt, .pth
/// or .ts, or holds a '/'.
bool is_script_path(const std::string& name);

}  // namespace shoal::models
