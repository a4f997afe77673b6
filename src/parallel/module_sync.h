// What the data-parallel wrappers (DistributedDataParallel, FullyShardedDataParallel) do to make
// every rank start from the same model: list the parameters once each, check that every rank
// built the same ones, and copy rank 0's values to the others.
//
// Thread safety: collective calls; one thread per rank drives them, in the same order everywhere.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/ordered_dict.h>

#include <string>
#include <vector>

#include "shoal/comm/process_group.h"

namespace shoal::parallel {

/// The module's parameters, each tensor once under its first name (tied weights: one tensor
/// registered under two names is listed once, as PyTorch deduplicates by identity).
torch::OrderedDict<std::string, at::Tensor> unique_named_parameters(const torch::nn::Module& module);

/// Checks that every rank holds the same parameters (names, shapes, dtypes, requires_grad); on a
/// mismatch every rank throws the same InvalidArgument naming `who`, the first parameter that
/// differs and how.
void verify_same_parameters(comm::ProcessGroup& group,
                            const torch::OrderedDict<std::string, at::Tensor>& named,
                            const char* who);

/// Copies rank `root`'s `tensors` to every rank in place, one broadcast per dtype.
void broadcast_coalesced(comm::ProcessGroup& group, const std::vector<at::Tensor>& tensors,
                         int root = 0);

}  // namespace shoal::parallel
