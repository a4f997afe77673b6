#include "shoal/pipeline/tied_parameters.h"

#include <torch/torch.h>

#include <algorithm>
#include <map>

#include "shoal/pipeline/pipeline_partition.h"

namespace shoal::pipeline {
namespace {

/// A parameter of the model (once, however many names it has) and the stages holding it.
struct Use {
  at::Tensor parameter;
  std::vector<int> stages;  // ascending
};

std::vector<Use> parameter_uses(const torch::nn::Sequential& model,
                                const std::vector<int64_t>& balance, int stages) {
  std::vector<Use> uses;
  std::map<const c10::TensorImpl*, size_t> index;
  for (int s = 0; s < stages; ++s) {
    for (const at::Tensor& p : stage_module(model, balance, s)->parameters()) {
      const auto found = index.emplace(p.unsafeGetTensorImpl(), uses.size());
      if (found.second) uses.push_back({p, {}});
      std::vector<int>& holders = uses[found.first->second].stages;
      if (holders.empty() || holders.back() != s) holders.push_back(s);
    }
  }
  return uses;
}

/// Creates, for every replica, the group of its ranks at `stages` (every rank of the grid
/// takes part); returns this rank's (null when its stage is not one of them).
std::shared_ptr<comm::ProcessGroup> new_stage_groups(const std::vector<int>& stages,
                                                     const PipelineGrid& grid) {
  std::shared_ptr<comm::ProcessGroup> mine;
  for (int r = 0; r < grid.replicas(); ++r) {
    std::vector<int> ranks;
    for (int s : stages) ranks.push_back(grid.rank_of(s, r));
    auto group = grid.group()->new_group(ranks);
    if (r == grid.replica()) mine = std::move(group);
  }
  return mine;
}

}  // namespace

TiedParameters::TiedParameters(const torch::nn::Sequential& model,
                               const std::vector<int64_t>& balance, const PipelineGrid& grid) {
  std::map<std::vector<int>, std::shared_ptr<comm::ProcessGroup>> groups;
  for (const Use& use : parameter_uses(model, balance, grid.stages())) {
    if (use.stages.size() < 2) continue;
    auto group = groups.find(use.stages);
    if (group == groups.end()) {
      group = groups.emplace(use.stages, new_stage_groups(use.stages, grid)).first;
    }
    if (std::find(use.stages.begin(), use.stages.end(), grid.stage()) == use.stages.end()) {
      continue;
    }
    held_.push_back({use.parameter, group->second, use.stages.front() == grid.stage()});
  }
  torch::NoGradGuard no_grad;
  for (Held& held : held_) {
    at::Tensor values = held.parameter;
    comm::BroadcastOptions options;
    options.root = 0;  // the group's first rank: the first stage holding it
    held.group->broadcast(values, options)->wait();
  }
}

TiedParameters::~TiedParameters() = default;

void TiedParameters::all_reduce_gradients() {
  std::vector<std::shared_ptr<comm::Work>> pending;
  for (Held& held : held_) {
    at::Tensor& grad = held.parameter.mutable_grad();
    if (!grad.defined()) grad = at::zeros_like(held.parameter);
    comm::AllreduceOptions options;
    options.note = "tied parameter";
    pending.push_back(held.group->allreduce(grad, options));
  }
  for (const auto& work : pending) work->wait();
}

std::vector<at::Tensor> TiedParameters::copies() const {
  std::vector<at::Tensor> result;
  for (const Held& held : held_) {
    if (!held.first) result.push_back(held.parameter);
  }
  return result;
}

}  // namespace shoal::pipeline
