// LocalSgdStrategy: `shoal train --strategy ddp --sync localsgd|diloco`, data parallelism that
// synchronises every --sync-every steps instead of every backward (parallel::LocalSGD and
// parallel::DiLoCo, torchft's semantics).
//
// prepare() copies rank 0's model to every rank; each rank then trains on its DistributedSampler
// shard with the trainer's optimizer (--optimizer: the inner one) and no gradient allreduce.
// Every --sync-every optimizer steps the replicas synchronise: LocalSGD averages the
// parameters; DiLoCo takes an outer Nesterov-SGD step (--outer-lr, --outer-momentum) on the
// averaged pseudo-gradient. Before evaluating and before saving a checkpoint (synchronize())
// the replicas synchronise early if they trained since the last sync, so that what is evaluated
// and saved is one model; the count of local steps starts again from there. BatchNorm statistics
// are each rank's own, as in torchft; evaluation and checkpoints use each rank's (rank 0's).
//
// Thread safety: as Strategy; one instance per process, used from the trainer's thread.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "shoal/comm/init.h"
#include "shoal/train/strategy.h"

namespace shoal::parallel {
class LocalSGD;
}

namespace torch::optim {
class Optimizer;
}

namespace shoal::train {

/// `shoal train --sync`: how data-parallel replicas synchronise.
enum class SyncKind {
  kEveryStep,  ///< "every-step": DDP, gradients averaged in every backward
  kLocalSgd,   ///< "localsgd": parameters averaged every --sync-every steps
  kDiLoCo,     ///< "diloco": an outer Nesterov-SGD step every --sync-every steps
};

/// The kind `name` names; InvalidArgument for any other.
SyncKind parse_sync(const std::string& name);
/// The name parse_sync reads as `kind`.
const char* sync_name(SyncKind kind);
/// Every kind's name, in the enum's order.
std::vector<std::string> sync_names();

/// The settings of LocalSgdStrategy; the defaults are `shoal train`'s.
struct LocalSgdOptions {
  SyncKind sync = SyncKind::kLocalSgd;
  /// Optimizer steps between syncs (torchft's sync_every, DiLoCo's H).
  int64_t sync_every = 100;
  /// DiLoCo's outer Nesterov SGD, as the DiLoCo paper sets it.
  double outer_lr = 0.7;
  double outer_momentum = 0.9;
};

/// Periodic synchronisation of data-parallel replicas (see the file comment).
class LocalSgdStrategy : public Strategy {
 public:
  /// Joins the process group now (so that rank() is known before the data is loaded).
  LocalSgdStrategy(const LocalSgdOptions& options, const comm::InitOptions& init = {});
  /// Uses an existing process group.
  LocalSgdStrategy(const LocalSgdOptions& options, std::shared_ptr<comm::ProcessGroup> group);
  ~LocalSgdStrategy() override;

  void prepare(TrainState& state) override;
  double train_step(TrainState& state, const at::Tensor& inputs,
                    const at::Tensor& targets) override;
  void synchronize(TrainState& state) override;
  at::Tensor epoch_indices(int64_t dataset_size, int64_t epoch, uint64_t seed,
                           int64_t consumed) override;
  void all_reduce_sum(std::vector<double>& values) override;
  int rank() const override;
  int world_size() const override;
  comm::ProcessGroup* process_group() override { return group_.get(); }
  /// "localsgd" or "diloco".
  std::string name() const override;
  std::string describe() const override;
  /// The parameters allreduced at syncs so far (no wait is measured).
  std::optional<CommStats> comm_stats() const override;

  /// Syncs so far (0 before prepare()).
  int64_t syncs() const;

 private:
  LocalSgdOptions options_;
  std::shared_ptr<comm::ProcessGroup> group_;
  std::unique_ptr<torch::optim::Optimizer> outer_;
  std::unique_ptr<parallel::LocalSGD> sync_;
};

}  // namespace shoal::train
