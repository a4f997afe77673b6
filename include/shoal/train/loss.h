// The losses the built-in trainer minimizes on a model's output (`shoal train --loss`), by name,
// with PyTorch's functional losses and their default reduction (the batch mean).
//
// A name is parsed into a Loss once, where it enters (the command line, a checkpoint's config);
// everything after works with the enum.
//
// Thread safety: functions of their arguments.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <string>
#include <vector>

namespace shoal::train {

/// A loss: the model's output and the targets of a batch to a scalar (the batch mean, as PyTorch's
/// losses with reduction='mean'), e.g. torch::nn::functional::cross_entropy.
using LossFunction = std::function<at::Tensor(const at::Tensor& output, const at::Tensor& target)>;

/// A model that computes its own loss (models::Model::owns_loss): a batch's inputs and targets to
/// its mean loss.
using BatchLoss = std::function<at::Tensor(const at::Tensor& inputs, const at::Tensor& targets)>;

/// The losses `shoal train --loss` names, after torch.nn.functional's functions.
enum class Loss {
  kCrossEntropy,  ///< cross_entropy: logits [N, C], class indices [N]
  kNll,           ///< nll_loss: log-probabilities [N, C], class indices [N]
  kMse,           ///< mse_loss: outputs and float targets of one shape
  kL1,            ///< l1_loss
  kSmoothL1,      ///< smooth_l1_loss (beta 1)
  kBceWithLogits, ///< binary_cross_entropy_with_logits: logits, float targets in [0, 1]
};

/// The Loss `name` means ("cross_entropy", "nll", "mse", "l1", "smooth_l1", "bce_with_logits").
/// Throws InvalidArgument naming the known ones.
Loss parse_loss(const std::string& name);

/// The name parse_loss reads as `loss`.
const char* loss_name(Loss loss);

/// Every loss's name, in the enum's order.
std::vector<std::string> loss_names();

/// True when `loss` takes integer class indices as targets (cross_entropy, nll): accuracy means
/// something. The others take float targets of the output's shape.
bool takes_class_targets(Loss loss);

/// `loss` as a function of a batch's output and targets. The regression losses take targets of the
/// output's shape; an output of the same number of values per sample (a model's [N, 1] for
/// targets [N]) is viewed as the targets' shape, and any other mismatch throws InvalidArgument
/// naming both shapes (PyTorch would broadcast [N, 1] against [N] to [N, N] and warn).
LossFunction loss_function(Loss loss);

/// Cross-entropy over logits [N, C] and class targets [N]: the default loss.
at::Tensor cross_entropy_loss(const at::Tensor& output, const at::Tensor& target);

}  // namespace shoal::train
