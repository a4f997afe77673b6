// The common interface of Shoal's built-in models: a torch::nn::Module with a virtual forward.
//
// LibTorch modules have no common forward (each declares its own), so code that trains "a model
// chosen by name" needs one. Built-in classifiers map an image batch [B,1,28,28] to logits
// [B,10]; a model may also compute its own loss from a batch (owns_loss: the GPT's
// forward(idx, targets), as nanoGPT's and Hugging Face's models do).
//
// A model whose forward is a chain of layers exposes that chain (as_sequential) for pipeline and
// model parallelism, and a model with a tensor-parallel plan applies it itself (parallelize), so
// nothing outside the models needs to know a model's layers or its class.
//
// Thread safety: as for any torch::nn::Module, not safe for concurrent mutation; concurrent
// forward passes without autograd on a module nobody modifies are fine.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <functional>
#include <memory>

namespace torch::nn {
class Sequential;
}

namespace shoal::comm {
class ProcessGroup;
}

namespace shoal::parallel {
class TensorParallelLayout;
}

namespace shoal::models {

/// What a built-in model is built for: samples [channels, height, width] (Fashion-MNIST's by
/// default; CIFAR-10's is 3 x 32 x 32) mapped to num_classes logits.
struct InputShape {
  int64_t channels = 1;
  int64_t height = 28;
  int64_t width = 28;
  int64_t num_classes = 10;
};

/// The loss of a model that owns_loss(), computed from the output of its as_sequential() chain:
/// what a pipeline's last stage minimizes, since the chain ends in the model's output (the GPT's
/// logits), not in its loss.
struct SequentialLoss {
  /// The batch's mean loss from the chain's output and the batch's targets.
  std::function<at::Tensor(const at::Tensor& output, const at::Tensor& targets)> loss;
  /// How many terms that mean averages for these targets (the GPT: the targets not ignored), so
  /// that micro-batches' losses weighted by it average to the whole batch's loss. Null: one term
  /// per sample.
  std::function<int64_t(const at::Tensor& targets)> terms;
};

/// Where a model's dropout draws its masks from. An undefined generator is torch's default one
/// (one process, or data parallelism: every replica's masks follow --seed). Tensor parallelism
/// sets both (parallel::tensor_parallel_dropout): Megatron's and PyTorch's rule, masks that agree
/// where the activations are replicated and differ where they are split.
struct DropoutGenerators {
  /// The embedding and residual dropout, on activations every TP rank holds whole.
  at::Generator replicated;
  /// The attention-probability dropout, on this TP rank's own heads.
  at::Generator sharded;
};

/// A module with one tensor in and one tensor out (logits), trainable by the built-in trainer.
class Model : public torch::nn::Module {
 public:
  using torch::nn::Module::Module;
  /// Maps inputs [B, ...] to logits [B, num_classes].
  virtual at::Tensor forward(at::Tensor input) = 0;
  /// True for a model that computes its own loss from a batch: the trainer minimizes
  /// forward_loss() instead of a loss of forward()'s output.
  virtual bool owns_loss() const { return false; }
  /// The batch's mean loss (a 0-dim tensor), for a model that owns_loss(); the others throw
  /// InvalidArgument.
  virtual at::Tensor forward_loss(const at::Tensor& inputs, const at::Tensor& targets);
  /// The model as a chain of layers that pipelines can cut into stages: the model's own layer
  /// objects (no copy) under their registered names, with the functional steps of its forward
  /// (relu, pooling, flatten) as parameter-free layers between them, or small modules grouping
  /// the model's own layers (the GPT's embeddings; its final LayerNorm and tied head), so the
  /// Sequential computes what forward() computes. A parameter two layers share (a tied weight)
  /// stays one tensor in both. Each call returns a new Sequential (a caller may regroup it
  /// freely). A model whose forward is not such a chain throws InvalidArgument.
  virtual torch::nn::Sequential as_sequential();
  /// A new model of the same kind and sizes holding a copy of this one's weights: what a strategy
  /// transforms when the trainer's own model must stay whole. Models that cannot be copied throw
  /// InvalidArgument.
  virtual std::shared_ptr<Model> copy() const;
  /// Splits this model over the tensor-parallel group `tp`, in place, by the model's own plan
  /// (parallel::parallelize_module), and returns what was split. Every rank of `tp` calls it on
  /// an equal model. Models without a plan throw InvalidArgument.
  virtual parallel::TensorParallelLayout parallelize(std::shared_ptr<comm::ProcessGroup> tp);
  /// For a model that owns_loss() and has an as_sequential() chain: its loss on the chain's
  /// output. Empty (the default) for a model without one: a pipeline then applies the trainer's
  /// loss to the chain's output, and refuses a model that owns its loss.
  virtual SequentialLoss sequential_loss() { return {}; }
  /// From now on the model's dropout draws its masks from `generators` (tensor parallelism's
  /// rule, parallel::tensor_parallel_dropout). A model without dropout ignores it.
  virtual void set_dropout_generators(const DropoutGenerators& /*generators*/) {}
  /// The samples the model was built for (another replica of it is built from the same shape).
  const InputShape& input_shape() const { return input_shape_; }

 protected:
  /// A new Sequential holding the layers of `layers` under their names (the same objects).
  static torch::nn::Sequential copy_of(torch::nn::Sequential& layers);

  InputShape input_shape_;
};

}  // namespace shoal::models
