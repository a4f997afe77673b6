#include "shoal/train/fsdp_strategy.h"

#include <torch/optim/optimizer.h>

#include <map>
#include <set>

#include "shoal/checkpoint/sharded_checkpoint.h"
#include "shoal/checkpoint/state_dict.h"
#include "shoal/checkpoint/training_state.h"
#include "shoal/error.h"
#include "shoal/parallel/fully_sharded_data_parallel.h"
#include "shoal/train/trainer.h"
#include "train/around_forward.h"

namespace shoal::train {

FsdpStrategy::FsdpStrategy(int stage, const comm::InitOptions& init)
    : FsdpStrategy(stage, comm::init_process_group(init)) {}

FsdpStrategy::FsdpStrategy(int stage, std::shared_ptr<comm::ProcessGroup> group)
    : stage_(stage), group_(std::move(group)) {
  parallel::sharding_strategy_from_stage(stage_);  // refuses anything but 1, 2, 3
  SHOAL_CHECK_T(InvalidArgument, group_ != nullptr, "FsdpStrategy: no process group given");
}

FsdpStrategy::~FsdpStrategy() = default;

void FsdpStrategy::prepare(TrainState& state) {
  parallel::FullyShardedDataParallelOptions options;
  options.sharding_strategy = parallel::sharding_strategy_from_stage(stage_);
  // Every submodule that holds parameters of its own is a unit (the built-in models' layers):
  // the policy with a threshold of one parameter wraps each leaf with parameters.
  options.auto_wrap_min_num_params = 1;
  auto fsdp = std::make_shared<parallel::FullyShardedDataParallel>(state.model, group_, options);
  fsdp_ = fsdp;
  // The trainer's optimizer is over the whole model (and holds a checkpoint's state after a
  // resume): the one that steps is over the shards, each rank taking its piece of that state.
  SHOAL_CHECK_T(InvalidArgument, state.optimizer != nullptr, "--strategy fsdp: no optimizer");
  auto sharded = parallel::optimizer_like(*state.optimizer, fsdp->parameters());
  fsdp->load_full_optimizer(*state.optimizer, *sharded);
  state.optimizer = std::move(sharded);
  // Gradient accumulation: the trainer's first N-1 micro-batches run in no_sync.
  state.no_sync = [fsdp] {
    return std::make_shared<parallel::FullyShardedDataParallel::NoSyncGuard>(fsdp->no_sync());
  };
  state.forward = around_forward(fsdp, state.model_forward);
  state.forward_loss = around_forward(fsdp, state.model_loss);
}

double FsdpStrategy::clip_grad_norm(TrainState& state, double max_norm) {
  // The module's parameters hold no gradients after a synchronised backward: the shards do.
  if (!fsdp_) return Strategy::clip_grad_norm(state, max_norm);
  return fsdp_->clip_grad_norm_(max_norm);
}

double FsdpStrategy::grad_norm(TrainState& state) {
  if (!fsdp_) return Strategy::grad_norm(state);
  return fsdp_->total_grad_norm();
}

torch::optim::Optimizer* FsdpStrategy::checkpoint_optimizer(TrainState& state) {
  if (!fsdp_) return state.optimizer.get();
  full_optimizer_ = fsdp_->full_optimizer(*state.optimizer);
  return full_optimizer_.get();
}

bool FsdpStrategy::sharded_checkpoint(TrainState& state, checkpoint::ShardedTrainingState& out) {
  SHOAL_CHECK_T(InvalidArgument, fsdp_ != nullptr,
                "FsdpStrategy::sharded_checkpoint before prepare(): nothing is sharded yet");
  out.rank = group_->rank();
  out.world_size = group_->size();
  // Indices in model.parameters(), as a full checkpoint's optimizer numbers them.
  std::map<std::string, int64_t> index;
  for (const auto& item : state.model->named_parameters()) {
    index.emplace(item.key(), static_cast<int64_t>(index.size()));
  }
  out.num_parameters = static_cast<int64_t>(index.size());
  std::set<std::string> sharded;
  for (const auto& unit : fsdp_->units()) {
    checkpoint::FlatUnitMetadata meta;
    meta.name = unit.name;
    meta.param_names = unit.parameter_names;
    meta.shapes = unit.shapes;
    meta.offsets = unit.offsets;
    meta.numel = unit.numel;
    meta.padded = unit.padded_numel;
    for (const auto& name : unit.parameter_names) {
      meta.param_indices.push_back(index.at(name));
      sharded.insert(name);
    }
    out.units.push_back(std::move(meta));
  }
  for (const at::Tensor& shard : fsdp_->parameters()) out.flat_param_shards.push_back(shard.detach());
  // The optimizer over the shards numbers them by unit: its state is each unit's piece.
  checkpoint::OptimizerState pieces = checkpoint::capture_optimizer(*state.optimizer);
  out.optimizer_shards.resize(out.units.size());
  for (auto& [unit, fields] : pieces.state) out.optimizer_shards.at(unit) = std::move(fields);
  // The replicated rest: buffers and parameters outside every unit (frozen ones), and the
  // optimizer's groups over the whole model, as a full checkpoint holds them.
  const checkpoint::StateDict whole = checkpoint::state_dict(*state.model);
  for (const auto& item : whole) {
    out.state_dict_keys.push_back(item.key());
    if (!sharded.count(item.key())) out.replicated.model.insert(item.key(), item.value());
  }
  out.replicated.optimizer.param_groups = std::move(pieces.param_groups);
  SHOAL_CHECK_T(InvalidArgument, out.replicated.optimizer.param_groups.size() == 1,
                "--checkpoint-format sharded: the optimizer has ",
                out.replicated.optimizer.param_groups.size(), " parameter groups; FSDP steps one");
  auto& params = out.replicated.optimizer.param_groups.front().params;
  params.clear();
  for (int64_t i = 0; i < out.num_parameters; ++i) params.push_back(i);
  out.replicated.rng_state = checkpoint::get_rng_state();
  return true;
}

void FsdpStrategy::synchronize(TrainState&) {
  if (fsdp_) fsdp_->gather_full_parameters();
}

at::Tensor FsdpStrategy::epoch_indices(int64_t dataset_size, int64_t epoch, uint64_t seed,
                                       int64_t consumed) {
  return sampler_indices(dataset_size, epoch, seed, rank(), world_size(), exactly_once(),
                         consumed);
}

void FsdpStrategy::all_reduce_sum(std::vector<double>& values) {
  train::all_reduce_sum(*group_, values);
}

int FsdpStrategy::rank() const { return group_->rank(); }
int FsdpStrategy::world_size() const { return group_->size(); }

}  // namespace shoal::train
