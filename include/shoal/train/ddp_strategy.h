// DdpStrategy: data-parallel training for the built-in trainer, PyTorch's DDP recipe in C++.
//
// prepare() joins the job's process group (init_process_group, env:// by default: RANK,
// WORLD_SIZE, MASTER_ADDR/PORT as set by `shoal run`, torchrun, mpirun or SLURM), wraps the model
// in DistributedDataParallel (which copies rank 0's weights to every rank and averages gradients
// during backward) and routes the trainer's forward through the wrapper. Each rank trains on its
// DistributedSampler shard (seed + epoch shuffle, padded to equal shares), so with B samples per
// rank and step the global batch is world_size x B, as in PyTorch.
//
// Thread safety: as Strategy; one instance per process, used from the trainer's thread.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "shoal/comm/init.h"
#include "shoal/parallel/comm_hooks.h"
#include "shoal/train/strategy.h"

namespace shoal::parallel {
class DistributedDataParallelBase;
struct ReducerStats;
}

namespace shoal::train {

/// DDP's communication hooks (PyTorch's register_comm_hook).
enum class CommHookKind {
  kAllreduce,  ///< "allreduce": DDP's own average, no hook
  kFp16,       ///< "fp16": fp16_compress_hook
  kBf16,       ///< "bf16": bf16_compress_hook
  kPowerSgd,   ///< "powersgd": powerSGD_hook
};

/// The hook `name` names ("allreduce", "fp16", "bf16", "powersgd"); InvalidArgument otherwise.
CommHookKind parse_comm_hook(const std::string& name);
/// The name parse_comm_hook reads as `kind`.
const char* comm_hook_name(CommHookKind kind);
/// Every hook's name, in the enum's order.
std::vector<std::string> comm_hook_names();

/// The hook `kind` registers on a DDP over `group`; null for kAllreduce (DDP's own averaging).
/// kPowerSgd runs with `power_sgd`'s state (null: PowerSGD's defaults).
parallel::CommHook make_comm_hook(CommHookKind kind, std::shared_ptr<comm::ProcessGroup> group,
                                  std::shared_ptr<parallel::PowerSGDState> power_sgd = nullptr);

/// Data-parallel training over a process group (see the file comment).
class DdpStrategy : public Strategy {
 public:
  /// Joins the process group now (so that rank() is known before the data is loaded).
  explicit DdpStrategy(const comm::InitOptions& init = {});
  /// Uses an existing process group (tests, or a group shared with other code).
  explicit DdpStrategy(std::shared_ptr<comm::ProcessGroup> group);
  ~DdpStrategy() override;

  /// The communication hook prepare() registers (PyTorch's register_comm_hook): "allreduce"
  /// (the default: average), "fp16" or "bf16" (fp16/bf16_compress_hook), or "powersgd"
  /// (powerSGD_hook with `power_sgd`'s rank, start iteration, error feedback and warm start; the
  /// caller may keep the state to read bytes_sent and iteration afterwards; null: defaults).
  void set_comm_hook(const std::string& name,
                     std::shared_ptr<parallel::PowerSGDState> power_sgd = nullptr);
  void set_comm_hook(CommHookKind kind,
                     std::shared_ptr<parallel::PowerSGDState> power_sgd = nullptr);
  /// The PowerSGD state the hook runs with (bytes_sent, iteration); null for other hooks.
  const std::shared_ptr<parallel::PowerSGDState>& power_sgd() const { return power_sgd_; }

  /// DDP's bucket_cap_mb for prepare(): MiB, or parallel::DistributedDataParallelOptions::
  /// kBucketCapAuto (chosen by timing the candidates in the first steps).
  void set_bucket_cap_mb(double cap_mb);

  void prepare(TrainState& state) override;
  std::string describe() const override;
  at::Tensor epoch_indices(int64_t dataset_size, int64_t epoch, uint64_t seed,
                           int64_t consumed) override;
  void all_reduce_sum(std::vector<double>& values) override;
  int rank() const override;
  int world_size() const override;
  comm::ProcessGroup* process_group() override { return group_.get(); }
  std::string name() const override { return "ddp"; }
  bool trains_on_gpu() const override { return true; }
  /// The reducer's: bytes of every bucket reduced, time blocked at the end of backward.
  std::optional<CommStats> comm_stats() const override;

  /// The DDP reducer's counters (synchronised backward passes, buckets); zeros before prepare().
  parallel::ReducerStats reducer_stats() const;

 protected:
  /// The DDP wrapper whose reducer comm_stats() reads (set by prepare()).
  void set_comm_stats_source(std::shared_ptr<parallel::DistributedDataParallelBase> ddp) {
    stats_source_ = std::move(ddp);
  }

 private:
  std::shared_ptr<comm::ProcessGroup> group_;
  CommHookKind comm_hook_ = CommHookKind::kAllreduce;
  double bucket_cap_mb_ = 25.0;
  std::shared_ptr<parallel::PowerSGDState> power_sgd_;
  std::shared_ptr<parallel::DistributedDataParallelBase> stats_source_;
};

}  // namespace shoal::train
