// torch.nn.utils.clip_grad_norm_ over the global L2 norm of gradients that may be spread over
// several processes (the stages of a pipeline): every process passes its own parameters and a
// sum across the processes that hold the rest.
//
// Thread safety: none of its own; call it from the thread that owns the gradients.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <vector>

namespace shoal::train {

/// Sums values across processes in place (Strategy::all_reduce_sum).
using SumAcross = std::function<void(std::vector<double>&)>;

/// The parameters of `parameters` with each tensor once (LibTorch lists a parameter registered
/// under two names, a tied weight, twice; PyTorch's parameters() yields it once).
std::vector<at::Tensor> unique_parameters(const std::vector<at::Tensor>& parameters);

/// PyTorch's clip_grad_norm_(parameters, max_norm) with norm_type 2: the total norm of all
/// gradients (those of tensors without one count as 0), and every gradient scaled by
/// min(1, max_norm / (total + 1e-6)). With `sum_across`, the squared norms are summed across
/// the processes (each of which holds `copies` identical copies of every gradient: a pipeline's
/// data-parallel replicas), so all of them scale by the same global factor. The gradients of
/// `uncounted` (some of `parameters`) are clipped but left out of the norm: copies of gradients
/// another process counts (a pipeline's tied weight on its last stage). Returns the total norm
/// (before clipping), as PyTorch does.
double clip_grad_norm_(const std::vector<at::Tensor>& parameters, double max_norm,
                       const SumAcross& sum_across = nullptr, double copies = 1,
                       const std::vector<at::Tensor>& uncounted = {});

/// The total norm clip_grad_norm_ clips (the same arguments, the same sum), without clipping:
/// what a trainer logs when it does not clip. NaN or inf when a gradient holds one. With
/// `sum_across`, a collective: every process calls it after the same backward.
double total_grad_norm(const std::vector<at::Tensor>& parameters,
                       const SumAcross& sum_across = nullptr, double copies = 1,
                       const std::vector<at::Tensor>& uncounted = {});

}  // namespace shoal::train
