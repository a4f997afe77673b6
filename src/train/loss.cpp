#include "shoal/train/loss.h"

#include <torch/nn/functional/loss.h>

#include <array>
#include <utility>

#include "shoal/error.h"

namespace shoal::train {
namespace {

namespace F = torch::nn::functional;

constexpr std::array<std::pair<Loss, const char*>, 6> kLossNames = {{
    {Loss::kCrossEntropy, "cross_entropy"},
    {Loss::kNll, "nll"},
    {Loss::kMse, "mse"},
    {Loss::kL1, "l1"},
    {Loss::kSmoothL1, "smooth_l1"},
    {Loss::kBceWithLogits, "bce_with_logits"},
}};

/// The output as the targets' shape when each sample has as many values as its target.
at::Tensor shaped_like(const at::Tensor& output, const at::Tensor& target, Loss loss) {
  if (output.sizes() == target.sizes()) return output;
  SHOAL_CHECK_T(InvalidArgument, output.numel() == target.numel(), "--loss ", loss_name(loss),
                ": the model's output has shape ", output.sizes(), " but the targets ",
                target.sizes(), "; a regression loss takes one target per output value");
  return output.view(target.sizes());
}

}  // namespace

Loss parse_loss(const std::string& name) {
  for (const auto& [loss, text] : kLossNames) {
    if (name == text) return loss;
  }
  std::string known;
  for (const auto& entry : kLossNames) {
    known += (known.empty() ? "" : ", ") + std::string(entry.second);
  }
  SHOAL_THROW(InvalidArgument, "unknown loss '", name, "'; known losses: ", known);
}

const char* loss_name(Loss loss) {
  for (const auto& [value, text] : kLossNames) {
    if (value == loss) return text;
  }
  return "unknown";
}

std::vector<std::string> loss_names() {
  std::vector<std::string> names;
  for (const auto& entry : kLossNames) names.emplace_back(entry.second);
  return names;
}

bool takes_class_targets(Loss loss) { return loss == Loss::kCrossEntropy || loss == Loss::kNll; }

at::Tensor cross_entropy_loss(const at::Tensor& output, const at::Tensor& target) {
  return F::cross_entropy(output, target);
}

LossFunction loss_function(Loss loss) {
  switch (loss) {
    case Loss::kCrossEntropy:
      return cross_entropy_loss;
    case Loss::kNll:
      return [](const at::Tensor& output, const at::Tensor& target) {
        return F::nll_loss(output, target);
      };
    case Loss::kMse:
      return [](const at::Tensor& output, const at::Tensor& target) {
        return F::mse_loss(shaped_like(output, target, Loss::kMse), target);
      };
    case Loss::kL1:
      return [](const at::Tensor& output, const at::Tensor& target) {
        return F::l1_loss(shaped_like(output, target, Loss::kL1), target);
      };
    case Loss::kSmoothL1:
      return [](const at::Tensor& output, const at::Tensor& target) {
        return F::smooth_l1_loss(shaped_like(output, target, Loss::kSmoothL1), target);
      };
    case Loss::kBceWithLogits:
      return [](const at::Tensor& output, const at::Tensor& target) {
        return F::binary_cross_entropy_with_logits(
            shaped_like(output, target, Loss::kBceWithLogits), target);
      };
  }
  SHOAL_THROW(InvalidArgument, "unknown loss ", static_cast<int>(loss));
}

}  // namespace shoal::train
