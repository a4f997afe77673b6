#include "shoal/train/tp_strategy.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/utils.h>

#include <cmath>
#include <set>
#include <sstream>

#include "shoal/checkpoint/training_state.h"
#include "shoal/error.h"
#include "shoal/models/model.h"
#include "shoal/parallel/distributed_data_parallel.h"
#include "shoal/parallel/fully_sharded_data_parallel.h"
#include "shoal/parallel/tensor_parallel.h"
#include "shoal/train/clip_grad.h"
#include "shoal/train/trainer.h"
#include "train/around_forward.h"

namespace shoal::train {
namespace {

std::string mesh_text(const std::vector<comm::MeshDimension>& mesh) {
  std::ostringstream text;
  for (size_t d = 0; d < mesh.size(); ++d) {
    text << (d ? "," : "") << mesh[d].first << "=" << mesh[d].second;
  }
  return text.str();
}

/// `mesh` with "dp" first (size 1 when not given), refused unless it holds the job's ranks.
std::vector<comm::MeshDimension> job_mesh(std::vector<comm::MeshDimension> mesh,
                                          const comm::ProcessGroup& group) {
  bool has_dp = false, has_tp = false;
  int64_t ranks = 1;
  for (const auto& [name, size] : mesh) {
    SHOAL_CHECK_T(InvalidArgument, name == "dp" || name == "tp", "--mesh ", mesh_text(mesh),
                  ": dimension '", name, "' is not supported; use dp and tp");
    has_dp |= name == "dp";
    has_tp |= name == "tp";
    ranks *= size;
  }
  SHOAL_CHECK_T(InvalidArgument, has_tp, "--mesh ", mesh_text(mesh), " has no tp dimension");
  SHOAL_CHECK_T(InvalidArgument, ranks == group.size(), "--mesh ", mesh_text(mesh), " holds ",
                ranks, " ranks but the job has ", group.size(),
                "; the sizes' product must be the number of processes");
  if (!has_dp) mesh.insert(mesh.begin(), {"dp", 1});
  return mesh;
}

/// Each parameter once, with its first name (the tied lm_head.weight is transformer.wte.weight).
std::vector<std::pair<std::string, at::Tensor>> unique_named_parameters(torch::nn::Module& module) {
  std::set<const c10::TensorImpl*> seen;
  std::vector<std::pair<std::string, at::Tensor>> named;
  for (const auto& item : module.named_parameters()) {
    if (seen.insert(item.value().unsafeGetTensorImpl()).second) {
      named.emplace_back(item.key(), item.value());
    }
  }
  return named;
}

/// The model's dropout under tensor parallelism (parallel::tensor_parallel_dropout), seeded from
/// --seed: the trainer seeds torch's default generator with it on every rank.
void seed_dropout(models::Model& model, const comm::DeviceMesh& mesh) {
  const uint64_t seed = at::detail::getDefaultCPUGenerator().current_seed();
  model.set_dropout_generators(parallel::tensor_parallel_dropout(seed, mesh.get_local_rank("tp"),
                                                                 mesh.get_local_rank("dp")));
}

}  // namespace

TpStrategy::TpStrategy(std::vector<comm::MeshDimension> mesh, const comm::InitOptions& init)
    : TpStrategy(std::move(mesh), comm::init_process_group(init)) {}

TpStrategy::TpStrategy(std::vector<comm::MeshDimension> mesh,
                       std::shared_ptr<comm::ProcessGroup> group)
    : group_(std::move(group)), mesh_(group_, job_mesh(std::move(mesh), *group_)) {}

TpStrategy::~TpStrategy() = default;

std::string TpStrategy::describe() const {
  std::ostringstream text;
  text << "mesh dp=" << mesh_.size("dp") << ",tp=" << mesh_.size("tp")
       << " (the model's layers split over tp by its plan; DDP over dp)";
  return text.str();
}

void TpStrategy::prepare(TrainState& state) {
  const auto* model = dynamic_cast<const models::Model*>(state.model.get());
  SHOAL_CHECK_T(InvalidArgument, model != nullptr,
                "--mesh splits a built-in model's layers (gpt, transformer)");
  SHOAL_CHECK_T(InvalidArgument, !state.autocast_dtype && !state.grad_scaler,
                "--precision bf16/fp16 is not supported with --mesh yet; use fp32");
  SHOAL_CHECK_T(InvalidArgument, state.optimizer != nullptr, "--mesh: no optimizer");
  split_ = model->copy();
  layout_ = std::make_unique<parallel::TensorParallelLayout>(
      split_->parallelize(mesh_.get_group("tp")));
  seed_dropout(*split_, mesh_);
  // The trainer's optimizer stays over its whole model, for checkpoints; this one steps the shards.
  std::vector<at::Tensor> params;
  for (const auto& [name, param] : unique_named_parameters(*split_)) params.push_back(param);
  kept_optimizer_ = std::move(state.optimizer);
  whole_optimizer_ = kept_optimizer_.get();
  state.optimizer = parallel::optimizer_like(*kept_optimizer_, params);
  load_whole_optimizer(state);
  whole_model_ = state.model;
  release_whole();
  // A training step frees what synchronize() gathered for evaluation or a checkpoint.
  BatchLoss loss = [this](const at::Tensor& x, const at::Tensor& y) {
    release_whole();
    return split_->forward_loss(x, y);
  };
  std::function<at::Tensor(const at::Tensor&)> forward = [this](const at::Tensor& x) {
    release_whole();
    return split_->forward(x);
  };
  if (mesh_.size("dp") > 1) {
    ddp_ = std::make_shared<parallel::DistributedDataParallelBase>(split_, mesh_.get_group("dp"));
    state.no_sync = [ddp = ddp_] {
      return std::make_shared<parallel::NoSyncGuard>(ddp->no_sync());
    };
    loss = around_forward(ddp_, loss);
    forward = around_forward(ddp_, forward);
  }
  // A model that owns its loss trains on forward_loss; the others on the trainer's loss of forward.
  if (state.model_loss) state.forward_loss = loss;
  state.forward = forward;
}

void TpStrategy::load_whole_optimizer(TrainState& state) {
  // Both optimizers list the model's parameters once each, in the same order (as in
  // checkpoint_optimizer): a resumed run's whole state, each split parameter's fields cut to this
  // rank's piece. A fresh run's state is empty.
  const auto named = unique_named_parameters(*split_);
  const auto whole_params = state.model->named_parameters();
  checkpoint::OptimizerState pieces = checkpoint::capture_optimizer(*kept_optimizer_);
  for (auto& [index, fields] : pieces.state) {
    const std::string& name = named.at(static_cast<size_t>(index)).first;
    if (!layout_->sharded().count(name)) continue;
    for (auto& [key, field] : fields) {
      if (field.sizes() == whole_params[name].sizes()) field = layout_->shard(name, field);
    }
  }
  checkpoint::restore_optimizer(pieces, *state.optimizer);
}

at::Tensor TpStrategy::epoch_indices(int64_t dataset_size, int64_t epoch, uint64_t seed,
                                     int64_t consumed) {
  // The ranks of a tp group train on the same samples.
  return sampler_indices(dataset_size, epoch, seed, static_cast<int>(mesh_.get_local_rank("dp")),
                         static_cast<int>(mesh_.size("dp")), exactly_once(), consumed);
}

void TpStrategy::all_reduce_sum(std::vector<double>& values) {
  train::all_reduce_sum(*group_, values);
}

void TpStrategy::synchronize(TrainState& state) {
  if (!layout_) return;
  const auto whole = layout_->full_state_dict();
  torch::NoGradGuard no_grad;
  for (auto& item : state.model->named_parameters()) {
    // The split layers' whole tensors were freed (release_whole): the gathered ones take their place.
    if (layout_->sharded().count(item.key())) {
      item.value().set_data(whole[item.key()]);
    } else {
      item.value().copy_(whole[item.key()]);
    }
  }
  whole_held_ = true;
}

void TpStrategy::release_whole() {
  if (!whole_held_) return;
  torch::NoGradGuard no_grad;
  for (auto& item : whole_model_->named_parameters()) {
    if (layout_->sharded().count(item.key())) item.value().set_data(at::empty({0}, item.value().options()));
  }
  // Rebuilt from the split optimizer for each checkpoint (checkpoint_optimizer).
  whole_optimizer_->state().clear();
  whole_held_ = false;
}

torch::optim::Optimizer* TpStrategy::checkpoint_optimizer(TrainState& state) {
  if (!layout_) return state.optimizer.get();
  // Both optimizers list the GPT's parameters once each, in the same order: index i is the same
  // parameter, whole in one and split in the other.
  const auto named = unique_named_parameters(*split_);
  checkpoint::OptimizerState gathered = checkpoint::capture_optimizer(*state.optimizer);
  for (auto& [index, fields] : gathered.state) {
    const auto& [name, param] = named.at(static_cast<size_t>(index));
    if (!layout_->sharded().count(name)) continue;
    for (auto& [key, field] : fields) {
      if (field.sizes() == param.sizes()) field = layout_->gather(name, field);
    }
  }
  checkpoint::restore_optimizer(gathered, *whole_optimizer_);
  return whole_optimizer_;
}

double TpStrategy::grad_norm(TrainState& state) {
  if (!layout_) return Strategy::grad_norm(state);
  // Squares of the split parameters' gradients, summed over the tp group, and of the others
  // (equal on every tp rank), once.
  at::Tensor squares = at::zeros({2}, at::kDouble);
  for (const auto& [name, param] : unique_named_parameters(*split_)) {
    if (!param.grad().defined()) continue;
    const double square = param.grad().to(at::kDouble).pow(2).sum().item<double>();
    squares[layout_->sharded().count(name) ? 0 : 1] += square;
  }
  at::Tensor split_part = squares.narrow(0, 0, 1).clone();
  comm::AllreduceOptions options;
  options.async_op = false;
  mesh_.get_group("tp")->allreduce(split_part, options)->wait();
  return std::sqrt(split_part.item<double>() + squares[1].item<double>());
}

double TpStrategy::clip_grad_norm(TrainState& state, double max_norm) {
  const double norm = grad_norm(state);
  // clip_grad_norm_'s rule: scale by max_norm / (norm + 1e-6) when that is below 1.
  const double scale = max_norm / (norm + 1e-6);
  if (scale < 1) {
    torch::NoGradGuard no_grad;
    for (const auto& [name, param] : unique_named_parameters(*split_)) {
      if (param.grad().defined()) param.mutable_grad().mul_(scale);
    }
  }
  return norm;
}

int TpStrategy::ranks_per_replica() const { return static_cast<int>(mesh_.size("tp")); }
int TpStrategy::rank() const { return group_->rank(); }
int TpStrategy::world_size() const { return group_->size(); }

}  // namespace shoal::train
