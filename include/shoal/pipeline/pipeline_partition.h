// Splitting a torch::nn::Sequential into K consecutive stages, one per pipeline rank.
//
// A partition is a `balance`: the number of layers of each stage, as in PyTorch's Pipe
// (balance=[2, 3] puts layers 0-1 on stage 0 and 2-4 on stage 1). It comes from explicit split
// points, from the layers' parameter counts, or from their measured forward+backward times; the
// balanced ones minimise the largest stage's cost, every stage getting at least one layer.
//
// stage_module() builds the Sequential of one stage over the same layer objects (no copy), under
// the layers' names in the whole model ("0", "1", ... or the names given at construction), so the
// stage's state dict keys are the whole model's keys and the stages' state dicts together are the
// model's state dict.
//
// Thread safety: pure functions, except balance_by_time, which runs the model.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <vector>

namespace shoal::pipeline {

/// Contiguous partition of `costs` (one per layer) into `stages` non-empty parts minimising the
/// largest part's sum (ties: the earliest split). Returns the number of layers per part.
std::vector<int64_t> balance_by_cost(const std::vector<double>& costs, int stages);

/// Balance by the number of parameter elements of each layer. Parameter-free layers (activations,
/// pooling, flatten) count as one element so that they still spread out.
std::vector<int64_t> balance_by_parameters(const torch::nn::Sequential& model, int stages);

/// Balance by each layer's measured forward+backward time on `sample` (a batch of inputs), the
/// median of `repeats` runs. Leaves the parameters' gradients zeroed.
std::vector<int64_t> balance_by_time(const torch::nn::Sequential& model, const at::Tensor& sample,
                                     int stages, int repeats = 3);

/// The balance for explicit split points: stage s starts at layer split_points[s-1] (strictly
/// increasing, inside (0, layers)). K - 1 split points give K stages.
std::vector<int64_t> balance_from_split_points(int64_t layers,
                                               const std::vector<int64_t>& split_points);

/// Checks `balance` (positive entries summing to `layers`); throws InvalidArgument otherwise.
void check_balance(const std::vector<int64_t>& balance, int64_t layers);

/// The first layer index of each stage, and one past the last stage: size K + 1.
std::vector<int64_t> stage_offsets(const std::vector<int64_t>& balance);

/// The layers of stage `stage` as a Sequential sharing the layer objects of `model`, each under its
/// name in `model`.
torch::nn::Sequential stage_module(const torch::nn::Sequential& model,
                                   const std::vector<int64_t>& balance, int stage);

}  // namespace shoal::pipeline
