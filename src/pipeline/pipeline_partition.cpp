#include "shoal/pipeline/pipeline_partition.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <limits>

#include "shoal/error.h"

namespace shoal::pipeline {

std::vector<int64_t> balance_by_cost(const std::vector<double>& costs, int stages) {
  const auto n = static_cast<int64_t>(costs.size());
  SHOAL_CHECK_T(InvalidArgument, stages >= 1 && stages <= n, "cannot split ", n,
                " layers into ", stages, " stages: every stage needs at least one layer");
  std::vector<double> prefix(static_cast<size_t>(n) + 1, 0.0);
  for (int64_t i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + costs[i];
  const double inf = std::numeric_limits<double>::infinity();
  // best[k][i]: the smallest possible largest part when the first i layers form k parts.
  std::vector<std::vector<double>> best(stages + 1, std::vector<double>(n + 1, inf));
  std::vector<std::vector<int64_t>> cut(stages + 1, std::vector<int64_t>(n + 1, 0));
  best[0][0] = 0;
  for (int k = 1; k <= stages; ++k) {
    for (int64_t i = k; i <= n; ++i) {
      for (int64_t j = k - 1; j < i; ++j) {
        const double candidate = std::max(best[k - 1][j], prefix[i] - prefix[j]);
        if (candidate < best[k][i]) {
          best[k][i] = candidate;
          cut[k][i] = j;
        }
      }
    }
  }
  std::vector<int64_t> balance(static_cast<size_t>(stages));
  int64_t end = n;
  for (int k = stages; k >= 1; --k) {
    balance[k - 1] = end - cut[k][end];
    end = cut[k][end];
  }
  return balance;
}

std::vector<int64_t> balance_by_parameters(const torch::nn::Sequential& model, int stages) {
  std::vector<double> costs;
  for (const auto& layer : model->children()) {
    int64_t count = 0;
    for (const at::Tensor& p : layer->parameters()) count += p.numel();
    costs.push_back(static_cast<double>(std::max<int64_t>(count, 1)));
  }
  return balance_by_cost(costs, stages);
}

std::vector<int64_t> balance_by_time(const torch::nn::Sequential& model, const at::Tensor& sample,
                                     int stages, int repeats) {
  SHOAL_CHECK_T(InvalidArgument, repeats >= 1, "balance_by_time: repeats must be at least 1");
  using Clock = std::chrono::steady_clock;
  torch::nn::Sequential layers_of = model;  // a handle on the same layers, to run them
  const size_t layers = model->size();
  std::vector<std::vector<double>> runs(layers);
  for (int r = 0; r < repeats; ++r) {
    at::Tensor x = sample;
    for (size_t i = 0; i < layers; ++i) {
      at::Tensor input = x.detach().requires_grad_(x.is_floating_point());
      const auto start = Clock::now();
      at::Tensor output = (layers_of->begin() + static_cast<std::ptrdiff_t>(i))->forward<at::Tensor>(input);
      if (output.requires_grad()) output.backward(at::ones_like(output));
      runs[i].push_back(std::chrono::duration<double>(Clock::now() - start).count());
      x = output.detach();
    }
  }
  for (auto& p : model->parameters()) {
    if (p.grad().defined()) p.mutable_grad().zero_();
  }
  std::vector<double> costs;
  for (auto& times : runs) {
    std::nth_element(times.begin(), times.begin() + times.size() / 2, times.end());
    costs.push_back(times[times.size() / 2]);
  }
  return balance_by_cost(costs, stages);
}

std::vector<int64_t> balance_from_split_points(int64_t layers,
                                               const std::vector<int64_t>& split_points) {
  std::vector<int64_t> balance;
  int64_t begin = 0;
  for (int64_t point : split_points) {
    SHOAL_CHECK_T(InvalidArgument, point > begin && point < layers, "split point ", point,
                  " must be after ", begin, " and before ", layers,
                  " (split points are increasing layer indices inside the model)");
    balance.push_back(point - begin);
    begin = point;
  }
  balance.push_back(layers - begin);
  return balance;
}

void check_balance(const std::vector<int64_t>& balance, int64_t layers) {
  SHOAL_CHECK_T(InvalidArgument, !balance.empty(), "a pipeline needs at least one stage");
  int64_t total = 0;
  for (size_t s = 0; s < balance.size(); ++s) {
    SHOAL_CHECK_T(InvalidArgument, balance[s] >= 1, "stage ", s, " has ", balance[s],
                  " layers; every stage needs at least one");
    total += balance[s];
  }
  SHOAL_CHECK_T(InvalidArgument, total == layers, "the stages hold ", total,
                " layers but the model has ", layers);
}

std::vector<int64_t> stage_offsets(const std::vector<int64_t>& balance) {
  std::vector<int64_t> offsets{0};
  for (int64_t count : balance) offsets.push_back(offsets.back() + count);
  return offsets;
}

torch::nn::Sequential stage_module(const torch::nn::Sequential& model,
                                   const std::vector<int64_t>& balance, int stage) {
  check_balance(balance, static_cast<int64_t>(model->size()));
  SHOAL_CHECK_T(InvalidArgument, stage >= 0 && stage < static_cast<int>(balance.size()), "stage ",
                stage, " is not one of ", balance.size(), " stages");
  const std::vector<int64_t> offsets = stage_offsets(balance);
  const auto names = model->named_children();
  torch::nn::Sequential result;
  for (int64_t i = offsets[stage]; i < offsets[stage + 1]; ++i) {
    result->push_back(names[i].key(), *(model->begin() + static_cast<std::ptrdiff_t>(i)));
  }
  return result;
}

}  // namespace shoal::pipeline
