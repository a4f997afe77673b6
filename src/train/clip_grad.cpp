#include "shoal/train/clip_grad.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>

#include "shoal/error.h"

namespace shoal::train {

std::vector<at::Tensor> unique_parameters(const std::vector<at::Tensor>& parameters) {
  std::vector<at::Tensor> unique;
  std::vector<const c10::TensorImpl*> seen;
  for (const at::Tensor& p : parameters) {
    if (std::find(seen.begin(), seen.end(), p.unsafeGetTensorImpl()) != seen.end()) continue;
    seen.push_back(p.unsafeGetTensorImpl());
    unique.push_back(p);
  }
  return unique;
}

double total_grad_norm(const std::vector<at::Tensor>& parameters, const SumAcross& sum_across,
                       double copies, const std::vector<at::Tensor>& uncounted) {
  torch::NoGradGuard no_grad;
  // As PyTorch: each gradient's norm in its own dtype, then the norm of those norms.
  std::vector<at::Tensor> norms;
  for (const at::Tensor& p : unique_parameters(parameters)) {
    const bool counted = std::none_of(uncounted.begin(), uncounted.end(),
                                      [&](const at::Tensor& u) { return u.is_same(p); });
    if (!counted) continue;
    const at::Tensor& g = p.grad();
    if (g.defined()) norms.push_back(at::linalg_vector_norm(g.detach(), 2));
  }
  double squared = 0;
  if (!norms.empty()) {
    const double local = at::linalg_vector_norm(at::stack(norms), 2).item<double>();
    squared = local * local;
  }
  if (sum_across) {
    std::vector<double> sum{squared};
    sum_across(sum);
    squared = sum[0] / copies;
  }
  return std::sqrt(squared);
}

double clip_grad_norm_(const std::vector<at::Tensor>& parameters, double max_norm,
                       const SumAcross& sum_across, double copies,
                       const std::vector<at::Tensor>& uncounted) {
  SHOAL_CHECK_T(InvalidArgument, std::isfinite(max_norm) && max_norm > 0,
                "clip_grad_norm_: max_norm must be a finite number > 0, got ", max_norm);
  const double total = total_grad_norm(parameters, sum_across, copies, uncounted);
  SHOAL_CHECK(std::isfinite(total), "clip_grad_norm_: the total gradient norm is ", total,
              "; the gradients hold NaN or inf (lower the learning rate, or check the data)");
  const double coefficient = std::min(1.0, max_norm / (total + 1e-6));
  if (coefficient < 1) {
    torch::NoGradGuard no_grad;
    for (const at::Tensor& p : unique_parameters(parameters)) {
      const at::Tensor& g = p.grad();
      if (g.defined()) g.mul_(coefficient);
    }
  }
  return total;
}

}  // namespace shoal::train
