#include "shoal/pipeline/pipeline_checkpoint.h"

#include <torch/torch.h>

#include <array>
#include <string>

#include "shoal/checkpoint/training_state.h"
#include "shoal/error.h"
#include "shoal/pipeline/pipeline_partition.h"

namespace shoal::pipeline {
namespace {

// Every per-parameter buffer of the optimizers checkpoint::capture_optimizer supports.
constexpr std::array<const char*, 5> kStateKeys = {"momentum_buffer", "step", "exp_avg",
                                                   "exp_avg_sq", "max_exp_avg_sq"};

void broadcast(comm::ProcessGroup& group, at::Tensor& tensor, int root) {
  comm::BroadcastOptions options;
  options.root = root;
  group.broadcast(tensor, options)->wait();
}

}  // namespace

void gather_stages(const torch::nn::Sequential& model, const std::vector<int64_t>& balance,
                   const PipelineGrid& grid, torch::optim::Optimizer* optimizer) {
  SHOAL_CHECK_T(InvalidArgument, static_cast<int>(balance.size()) == grid.stages(),
                "gather_stages: a balance of ", balance.size(), " stages for a grid of ",
                grid.stages());
  comm::ProcessGroup& group = *grid.group();
  torch::NoGradGuard no_grad;
  checkpoint::OptimizerState state;
  std::vector<at::Tensor> optimized;
  if (optimizer != nullptr) {
    state = checkpoint::capture_optimizer(*optimizer);
    for (const auto& param_group : optimizer->param_groups()) {
      for (const auto& p : param_group.params()) optimized.push_back(p);
    }
  }
  for (int s = 0; s < grid.stages(); ++s) {
    const int root = grid.rank_of(s, 0);
    const bool owner = group.rank() == root;
    const torch::nn::Sequential stage = stage_module(model, balance, s);
    for (at::Tensor tensor : stage->parameters()) broadcast(group, tensor, root);
    for (at::Tensor tensor : stage->buffers()) broadcast(group, tensor, root);
    if (optimizer == nullptr) continue;
    for (const at::Tensor& param : stage->parameters()) {
      int64_t index = -1;
      for (size_t i = 0; i < optimized.size(); ++i) {
        if (optimized[i].is_same(param)) index = static_cast<int64_t>(i);
      }
      if (index < 0) continue;  // not optimized (the same on every rank: same model)
      at::Tensor present = at::zeros({static_cast<int64_t>(kStateKeys.size())}, at::kInt);
      auto& buffers = state.state[index];
      if (owner) {
        for (size_t k = 0; k < kStateKeys.size(); ++k) {
          present[static_cast<int64_t>(k)] = buffers.count(kStateKeys[k]) ? 1 : 0;
        }
      }
      broadcast(group, present, root);
      for (size_t k = 0; k < kStateKeys.size(); ++k) {
        if (present[static_cast<int64_t>(k)].item<int>() == 0) {
          buffers.erase(kStateKeys[k]);
          continue;
        }
        at::Tensor tensor;
        if (owner) {
          tensor = buffers.at(kStateKeys[k]).contiguous();
        } else if (std::string(kStateKeys[k]) == "step") {
          tensor = at::zeros({}, at::kFloat);
        } else {
          tensor = at::zeros_like(param);
        }
        broadcast(group, tensor, root);
        buffers[kStateKeys[k]] = tensor;
      }
      if (buffers.empty()) state.state.erase(index);
    }
  }
  if (optimizer != nullptr) checkpoint::restore_optimizer(state, *optimizer);
}

}  // namespace shoal::pipeline
