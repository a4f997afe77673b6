// StrategySpec: which training strategy a run uses and its settings, as `shoal train`'s strategy
// flags give them. validate() checks them against the run's TrainOptions (the rules between a
// strategy and the options it can train with live here, once, for the CLI and C++ users alike),
// launch_options() is the job a process not started as a rank launches, and make_strategy()
// builds a rank's Strategy.
//
// Thread safety: a plain value type.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "shoal/train/ddp_strategy.h"
#include "shoal/train/local_sgd_strategy.h"
#include "shoal/train/strategy.h"
#include "shoal/train/train_options.h"

namespace shoal::launcher {
struct LaunchOptions;
}

namespace shoal::train {

/// The strategies `shoal train --strategy` names.
enum class StrategyKind { kSingle, kDdp, kFsdp, kDp, kPs, kPipeline };

/// The strategy `name` names ("single", "ddp", "fsdp", "dp", "ps", "pipeline"); InvalidArgument
/// for any other.
StrategyKind parse_strategy(const std::string& name);
/// The name parse_strategy reads as `kind`.
const char* strategy_name(StrategyKind kind);
/// Every strategy's name, in the enum's order.
std::vector<std::string> strategy_names();

/// What only some strategies can do (StrategySpec::supports).
enum class StrategyFeature {
  kGpu,                ///< train on --device cuda: single, and ddp without model parallelism or --sync
  kCommHook,           ///< --comm-hook and --bucket-cap-mb: ddp without model parallelism or --sync
  kShardedCheckpoint,  ///< --checkpoint-format sharded: fsdp
  kClipGradNorm,       ///< --clip-grad-norm: all but ps (no process holds the global gradient)
};

/// A training strategy and its settings (see the file comment). The defaults are `shoal train`'s.
struct StrategySpec {
  StrategyKind kind = StrategyKind::kSingle;
  /// ddp, fsdp started directly: processes launched on this host.
  int nproc_per_node = 2;
  /// Process-group backend (comm::InitOptions::backend).
  std::string backend = "auto";
  /// ddp, fsdp, pipeline: restarts of all ranks when one dies.
  int max_restarts = 0;
  // ps
  std::string consistency = "bsp";  ///< bsp, asp or ssp (ps::parse_consistency)
  int staleness = 2;
  int servers = 1;
  int workers = 2;
  double worker_timeout_s = 60;
  // ddp
  CommHookKind comm_hook = CommHookKind::kAllreduce;
  /// MiB, or parallel::DistributedDataParallelOptions::kBucketCapAuto; unset: DDP's default.
  std::optional<double> bucket_cap_mb;
  int64_t powersgd_rank = 1;
  int64_t powersgd_start_iter = 1000;
  int model_parallel = 1;  ///< ddp: parts each rank's model is split into
  /// ddp: how the replicas synchronise (every-step: DDP; localsgd, diloco: LocalSgdStrategy, with
  /// sync_every, and DiLoCo's outer_lr and outer_momentum).
  SyncKind sync = SyncKind::kEveryStep;
  int64_t sync_every = LocalSgdOptions{}.sync_every;
  double outer_lr = LocalSgdOptions{}.outer_lr;
  double outer_momentum = LocalSgdOptions{}.outer_momentum;
  /// ddp: keep training when a rank dies (FaultTolerantDdpStrategy), as long as at least
  /// min_replicas ranks are left.
  bool fault_tolerant = false;
  int min_replicas = 1;
  /// --mesh "dp=2,tp=2" (comm::parse_mesh; empty: none): single or ddp become tensor parallelism
  /// over tp and data parallelism over dp (TpStrategy), a job of the mesh's ranks.
  std::string mesh;
  // fsdp
  int shard = 3;  ///< ZeRO stage
  // pipeline
  int stages = 2;
  int64_t micro_batches = 4;
  std::string schedule = "1f1b";  ///< gpipe or 1f1b
  bool recompute = false;
  /// dp: replicas (0: 2); pipeline: data-parallel replicas of the pipeline (0: 1).
  int replicas = 0;

  /// Whether this strategy, with these settings, can do `feature`.
  bool supports(StrategyFeature feature) const;
  /// Throws InvalidArgument naming the flags when `options` ask what this strategy cannot do:
  /// validate_sync, then validate_settings.
  void validate(const TrainOptions& options) const;
  /// validate()'s rules of --sync: its strategy and the flags it cannot go with. They read no
  /// option a resume inherits, so `shoal train` checks them before it reads a checkpoint.
  void validate_sync(const TrainOptions& options) const;
  /// validate()'s other rules (--fault-tolerant's among them), checked on the options a resume
  /// ends with.
  void validate_settings(const TrainOptions& options) const;
  /// validate()'s rules of --fault-tolerant: the settings it cannot train with.
  void validate_fault_tolerant(const TrainOptions& options) const;
  /// replicas, or the strategy's default for 0.
  int replica_count() const;
  /// Whether the strategy runs as a job of processes (ddp, fsdp, pipeline, ps).
  bool runs_as_job() const;
  /// The processes a job launched on this host runs (1 for single and dp).
  int local_processes() const;
  /// The job that runs `command` (this program's own command line) as each of its processes.
  launcher::LaunchOptions launch_options(std::vector<std::string> command) const;
  /// This rank's strategy (a ps worker's for ps; a server runs ps::serve instead).
  std::unique_ptr<Strategy> make_strategy(const TrainOptions& options) const;
};

}  // namespace shoal::train
