#include "shoal/train/local_sgd_strategy.h"

#include <torch/optim/sgd.h>

#include <iterator>
#include <sstream>

#include "shoal/comm/process_group.h"
#include "shoal/error.h"
#include "shoal/parallel/local_sgd.h"
#include "shoal/train/trainer.h"

namespace shoal::train {
namespace {
constexpr const char* kSyncNames[] = {"every-step", "localsgd", "diloco"};
}  // namespace

SyncKind parse_sync(const std::string& name) {
  for (size_t i = 0; i < std::size(kSyncNames); ++i) {
    if (name == kSyncNames[i]) return static_cast<SyncKind>(i);
  }
  SHOAL_THROW(InvalidArgument, "--sync must be every-step, localsgd or diloco, got '", name, "'");
}

const char* sync_name(SyncKind kind) { return kSyncNames[static_cast<size_t>(kind)]; }

std::vector<std::string> sync_names() { return {std::begin(kSyncNames), std::end(kSyncNames)}; }

LocalSgdStrategy::LocalSgdStrategy(const LocalSgdOptions& options, const comm::InitOptions& init)
    : LocalSgdStrategy(options, comm::init_process_group(init)) {}

LocalSgdStrategy::LocalSgdStrategy(const LocalSgdOptions& options,
                                   std::shared_ptr<comm::ProcessGroup> group)
    : options_(options), group_(std::move(group)) {
  SHOAL_CHECK_T(InvalidArgument, group_ != nullptr, "LocalSgdStrategy: no process group given");
  SHOAL_CHECK_T(InvalidArgument, options_.sync != SyncKind::kEveryStep,
                "LocalSgdStrategy: --sync every-step is DDP (DdpStrategy)");
  SHOAL_CHECK_T(InvalidArgument, options_.sync_every >= 1, "--sync-every must be at least 1, got ",
                options_.sync_every);
}

LocalSgdStrategy::~LocalSgdStrategy() = default;

void LocalSgdStrategy::prepare(TrainState& state) {
  Strategy::prepare(state);  // each replica's forward is the model's own
  SHOAL_CHECK_T(InvalidArgument, state.optimizer != nullptr, "--sync ", sync_name(options_.sync),
                ": no optimizer");
  if (options_.sync == SyncKind::kLocalSgd) {
    sync_ = std::make_unique<parallel::LocalSGD>(state.model, group_, options_.sync_every);
    return;
  }
  outer_ = std::make_unique<torch::optim::SGD>(
      state.model->parameters(),
      torch::optim::SGDOptions(options_.outer_lr).momentum(options_.outer_momentum).nesterov(true));
  sync_ = std::make_unique<parallel::DiLoCo>(state.model, *state.optimizer, *outer_, group_,
                                             options_.sync_every);
}

double LocalSgdStrategy::train_step(TrainState& state, const at::Tensor& inputs,
                                    const at::Tensor& targets) {
  SHOAL_CHECK(sync_ != nullptr, "LocalSgdStrategy: train_step before prepare()");
  const double loss = Strategy::train_step(state, inputs, targets);
  sync_->step();
  return loss;
}

void LocalSgdStrategy::synchronize(TrainState&) {
  if (sync_ && sync_->local_step() > 0) sync_->sync();
}

at::Tensor LocalSgdStrategy::epoch_indices(int64_t dataset_size, int64_t epoch, uint64_t seed,
                                           int64_t consumed) {
  return sampler_indices(dataset_size, epoch, seed, rank(), world_size(), exactly_once(),
                         consumed);
}

void LocalSgdStrategy::all_reduce_sum(std::vector<double>& values) {
  train::all_reduce_sum(*group_, values);
}

int LocalSgdStrategy::rank() const { return group_->rank(); }
int LocalSgdStrategy::world_size() const { return group_->size(); }

std::string LocalSgdStrategy::name() const { return sync_name(options_.sync); }

std::string LocalSgdStrategy::describe() const {
  std::ostringstream text;
  text << "sync every " << options_.sync_every << " steps: ";
  if (options_.sync == SyncKind::kLocalSgd) {
    text << "parameters averaged (LocalSGD)";
  } else {
    text << "outer Nesterov SGD on the averaged pseudo-gradient, lr " << options_.outer_lr
         << ", momentum " << options_.outer_momentum << " (DiLoCo)";
  }
  return text.str();
}

std::optional<CommStats> LocalSgdStrategy::comm_stats() const {
  if (!sync_) return std::nullopt;
  CommStats stats;
  stats.bytes = sync_->bytes_reduced();
  return stats;
}

int64_t LocalSgdStrategy::syncs() const { return sync_ ? sync_->syncs() : 0; }

}  // namespace shoal::train
