#include "shoal/parallel/local_sgd.h"

#include <torch/optim/optimizer.h>

#include <map>

#include "parallel/module_sync.h"
#include "shoal/comm/process_group.h"
#include "shoal/error.h"

namespace shoal::parallel {
namespace {

std::vector<at::Tensor> local_sgd_parameters(const torch::nn::Module& module) {
  std::vector<at::Tensor> out;
  for (const auto& item : unique_named_parameters(module)) out.push_back(item.value());
  return out;
}

// Whether every tensor of `params` is one the optimizer steps (is_same: the same tensor).
bool steps_all_of(const torch::optim::Optimizer& optimizer, const std::vector<at::Tensor>& params) {
  for (const auto& p : params) {
    bool found = false;
    for (const auto& group : optimizer.param_groups()) {
      for (const auto& q : group.params()) found = found || q.is_same(p);
    }
    if (!found) return false;
  }
  return true;
}

}  // namespace

LocalSGD::LocalSGD(std::shared_ptr<torch::nn::Module> module,
                   std::shared_ptr<comm::ProcessGroup> group, int64_t sync_every)
    : module_(std::move(module)), group_(std::move(group)), sync_every_(sync_every) {
  SHOAL_CHECK_T(InvalidArgument, module_ != nullptr, "LocalSGD: no module given");
  SHOAL_CHECK_T(InvalidArgument, group_ != nullptr, "LocalSGD: no process group given");
  SHOAL_CHECK_T(InvalidArgument, sync_every_ >= 1, "LocalSGD: sync_every must be at least 1, got ",
                sync_every_);
  const auto named = unique_named_parameters(*module_);
  verify_same_parameters(*group_, named, "LocalSGD");
  parameters_ = local_sgd_parameters(*module_);
  std::vector<at::Tensor> start = parameters_;
  for (const auto& b : module_->buffers()) start.push_back(b);
  broadcast_coalesced(*group_, start);
}

LocalSGD::~LocalSGD() = default;

bool LocalSGD::step() {
  if (++local_step_ < sync_every_) return false;
  sync();
  return true;
}

void LocalSGD::sync() {
  perform_sync();
  local_step_ = 0;
  ++syncs_;
}

void LocalSGD::perform_sync() {
  torch::NoGradGuard no_grad;
  average(parameters_);
}

void LocalSGD::average(const std::vector<at::Tensor>& tensors) {
  torch::NoGradGuard no_grad;
  std::map<at::ScalarType, std::vector<at::Tensor>> by_type;
  for (const auto& t : tensors) {
    if (t.numel() > 0) by_type[t.scalar_type()].push_back(t);
  }
  const double world = static_cast<double>(group_->size());
  for (auto& [type, list] : by_type) {
    std::vector<at::Tensor> flat;
    for (const auto& t : list) flat.push_back(t.reshape({-1}));
    at::Tensor buffer = torch::cat(flat);
    group_->allreduce(buffer)->wait();
    buffer.div_(world);
    bytes_reduced_ += static_cast<double>(buffer.numel() * buffer.element_size());
    int64_t offset = 0;
    for (auto& t : list) {
      t.copy_(buffer.narrow(0, offset, t.numel()).view(t.sizes()));
      offset += t.numel();
    }
  }
}

DiLoCo::DiLoCo(std::shared_ptr<torch::nn::Module> module, torch::optim::Optimizer& inner_optimizer,
               torch::optim::Optimizer& outer_optimizer, std::shared_ptr<comm::ProcessGroup> group,
               int64_t sync_every)
    : LocalSGD(std::move(module), std::move(group), sync_every), outer_(outer_optimizer) {
  SHOAL_CHECK_T(InvalidArgument, steps_all_of(inner_optimizer, parameters()),
                "DiLoCo: the inner optimizer must be built over the module's parameters");
  SHOAL_CHECK_T(InvalidArgument, steps_all_of(outer_optimizer, parameters()),
                "DiLoCo: the outer optimizer must be built over the module's parameters (it steps "
                "them from the global copy)");
  torch::NoGradGuard no_grad;
  for (const auto& p : parameters()) global_.push_back(p.detach().clone());
}

void DiLoCo::perform_sync() {
  torch::NoGradGuard no_grad;
  const std::vector<at::Tensor>& params = parameters();
  // torchft's sign: global - local, so that the outer optimizer's descent moves towards the
  // replicas' average.
  std::vector<at::Tensor> pseudo;
  for (size_t i = 0; i < params.size(); ++i) pseudo.push_back(global_[i] - params[i]);
  average(pseudo);
  for (size_t i = 0; i < params.size(); ++i) {
    at::Tensor p = params[i];
    p.copy_(global_[i]);
    p.mutable_grad() = pseudo[i];
  }
  outer_.step();
  for (size_t i = 0; i < params.size(); ++i) {
    global_[i].copy_(params[i]);
    // The inner steps start from no gradient (torchft's outer zero_grad, set_to_none).
    at::Tensor p = params[i];
    p.mutable_grad().reset();
  }
}

}  // namespace shoal::parallel
