#include "shoal/train/strategy_spec.h"

#include <iterator>

#include "shoal/comm/device_mesh.h"
#include "shoal/comm/init.h"
#include "shoal/error.h"
#include "shoal/launcher/launch.h"
#include "shoal/log.h"
#include "shoal/parallel/distributed_data_parallel.h"
#include "shoal/parallel/tensor_parallel.h"
#include "shoal/pipeline/schedule.h"
#include "shoal/train/data_parallel_strategy.h"
#include "shoal/train/fault_tolerant_ddp_strategy.h"
#include "shoal/train/fsdp_strategy.h"
#include "shoal/train/model_parallel_ddp_strategy.h"
#include "shoal/train/pipeline_strategy.h"
#include "shoal/train/ps_strategy.h"
#include "shoal/train/tp_strategy.h"

namespace shoal::train {
namespace {
constexpr const char* kStrategyNames[] = {"single", "ddp", "fsdp", "dp", "ps", "pipeline"};

/// The mesh's ranks (all its sizes multiplied).
int mesh_ranks(const std::string& mesh) {
  int64_t ranks = 1;
  for (const auto& dimension : comm::parse_mesh(mesh)) ranks *= dimension.second;
  return static_cast<int>(ranks);
}

/// What --mesh cannot train with (yet), each refused in one line.
void validate_mesh(const std::string& mesh, StrategyKind kind, int model_parallel,
                   const TrainOptions& options) {
  int64_t tp = 0;
  for (const auto& [name, size] : comm::parse_mesh(mesh)) {
    SHOAL_CHECK_T(InvalidArgument, name == "dp" || name == "tp", "--mesh ", mesh,
                  ": dimension '", name, "' is not supported; use dp and tp (e.g. dp=2,tp=2)");
    if (name == "tp") tp = size;
  }
  SHOAL_CHECK_T(InvalidArgument, tp > 0, "--mesh ", mesh, " has no tp dimension (e.g. dp=2,tp=2)");
  SHOAL_CHECK_T(InvalidArgument, kind == StrategyKind::kSingle || kind == StrategyKind::kDdp,
                "--mesh applies to --strategy ddp (or none), not ", strategy_name(kind));
  SHOAL_CHECK_T(InvalidArgument, model_parallel == 1, "--model-parallel and --mesh do not combine");
  SHOAL_CHECK_T(InvalidArgument, options.model == "gpt" || options.model == "transformer",
                "--mesh splits the layers of --model gpt or transformer; --model ", options.model,
                " cannot be split by tensor parallelism");
  if (options.model == "gpt") parallel::check_gpt_tensor_parallel(options.gpt, tp);
  SHOAL_CHECK_T(InvalidArgument, options.precision == Precision::kFp32,
                "--precision ", precision_name(options.precision), " with --mesh is not supported yet; use fp32");
}
}  // namespace

StrategyKind parse_strategy(const std::string& name) {
  for (size_t i = 0; i < std::size(kStrategyNames); ++i) {
    if (name == kStrategyNames[i]) return static_cast<StrategyKind>(i);
  }
  SHOAL_THROW(InvalidArgument, "--strategy must be single, ddp, fsdp, dp, ps or pipeline, got '",
              name, "'");
}

const char* strategy_name(StrategyKind kind) { return kStrategyNames[static_cast<size_t>(kind)]; }

std::vector<std::string> strategy_names() {
  return {std::begin(kStrategyNames), std::end(kStrategyNames)};
}

bool StrategySpec::supports(StrategyFeature feature) const {
  // --sync localsgd/diloco replaces DDP's reducer, and --mesh its model: none of its settings apply.
  const bool plain_ddp = kind == StrategyKind::kDdp && model_parallel == 1 &&
                         sync == SyncKind::kEveryStep && mesh.empty();
  switch (feature) {
    case StrategyFeature::kGpu:
      return (kind == StrategyKind::kSingle && mesh.empty()) || plain_ddp;
    case StrategyFeature::kCommHook:
      return plain_ddp;
    case StrategyFeature::kShardedCheckpoint:
      return kind == StrategyKind::kFsdp;
    case StrategyFeature::kClipGradNorm:
      return kind != StrategyKind::kPs;
  }
  return false;
}

void StrategySpec::validate(const TrainOptions& options) const {
  validate_sync(options);
  validate_settings(options);
}

void StrategySpec::validate_settings(const TrainOptions& options) const {
  log::debug("shoal: checked the strategy's settings");
  validate_fault_tolerant(options);
  const std::string strategy = strategy_name(kind);
  if (!mesh.empty()) validate_mesh(mesh, kind, model_parallel, options);
  // Said before any data is read (whether this machine has a GPU, the trainer says).
  check_strategy_device(options.device, supports(StrategyFeature::kGpu),
                        strategy + (model_parallel == 1 ? "" : " with --model-parallel"));
  SHOAL_CHECK_T(InvalidArgument,
                comm_hook == CommHookKind::kAllreduce || supports(StrategyFeature::kCommHook),
                "--comm-hook ", comm_hook_name(comm_hook),
                " applies to --strategy ddp (without --model-parallel)");
  SHOAL_CHECK_T(InvalidArgument, !bucket_cap_mb || supports(StrategyFeature::kCommHook),
                "--bucket-cap-mb applies to --strategy ddp (without --model-parallel)");
  SHOAL_CHECK_T(InvalidArgument, kind != StrategyKind::kFsdp || model_parallel == 1,
                "--model-parallel applies to --strategy ddp, not fsdp");
  SHOAL_CHECK_T(InvalidArgument,
                options.checkpoint_format == CheckpointFormat::kFull || supports(StrategyFeature::kShardedCheckpoint),
                "--checkpoint-format sharded applies to --strategy fsdp (the others hold whole "
                "models: use the default, full)");
  SHOAL_CHECK_T(InvalidArgument,
                options.clip_grad_norm == 0 || supports(StrategyFeature::kClipGradNorm),
                "--clip-grad-norm is not supported with --strategy ps (each worker pushes its own "
                "gradient; the servers never hold the global one): use ddp, dp, pipeline or single");
  // The servers' SGD (ps::Sgd) has no weight decay.
  SHOAL_CHECK_T(InvalidArgument,
                kind != StrategyKind::kPs || options.optimizer != Optimizer::kSgd ||
                    options.weight_decay.value_or(0) == 0,
                "--weight-decay with --optimizer sgd is not supported with --strategy ps; use "
                "--optimizer adamw or adam");
}

void StrategySpec::validate_sync(const TrainOptions& options) const {
  log::debug("shoal: checked --sync");
  if (sync == SyncKind::kEveryStep) return;
  const std::string flag = std::string("--sync ") + sync_name(sync);
  SHOAL_CHECK_T(InvalidArgument, kind == StrategyKind::kDdp, flag,
                " applies to --strategy ddp (replicas of the whole model), not ", strategy_name(kind));
  SHOAL_CHECK_T(InvalidArgument, model_parallel == 1, flag, " does not go with --model-parallel");
  SHOAL_CHECK_T(InvalidArgument, mesh.empty(), flag, " does not go with --mesh");
  SHOAL_CHECK_T(InvalidArgument, options.device == "cpu", "--device ", options.device, ": ", flag,
                " trains on the CPU here; use --sync every-step (DDP) on a GPU");
  SHOAL_CHECK_T(InvalidArgument, comm_hook == CommHookKind::kAllreduce && !bucket_cap_mb, flag,
                " averages no gradients: --comm-hook and --bucket-cap-mb do not apply");
  SHOAL_CHECK_T(InvalidArgument, sync_every >= 1, "--sync-every must be at least 1, got ",
                sync_every);
  // A checkpoint holds rank 0's model and inner optimizer, not DiLoCo's global copy and outer
  // momentum, nor where the replicas were between syncs.
  SHOAL_CHECK_T(InvalidArgument, !options.resume && max_restarts == 0, flag,
                " cannot resume (--resume, --max-restarts): its checkpoints hold no sync state");
}

void StrategySpec::validate_fault_tolerant(const TrainOptions& options) const {
  SHOAL_CHECK_T(InvalidArgument, fault_tolerant || min_replicas == 1,
                "--min-replicas applies to --fault-tolerant; add it, or drop --min-replicas");
  if (!fault_tolerant) return;
  const char* flag = "--fault-tolerant";
  SHOAL_CHECK_T(InvalidArgument, kind == StrategyKind::kDdp, flag,
                " applies to --strategy ddp (one whole model per rank), not ", strategy_name(kind));
  SHOAL_CHECK_T(InvalidArgument, model_parallel == 1 && mesh.empty(), flag,
                " does not go with --model-parallel or --mesh (a replica must be one rank)");
  SHOAL_CHECK_T(InvalidArgument, sync == SyncKind::kEveryStep, flag, " does not go with --sync ",
                sync_name(sync), " yet; use --sync every-step");
  SHOAL_CHECK_T(InvalidArgument, options.device == "cpu", "--device ", options.device, ": ", flag,
                " trains on the CPU (gloo) only; use --device cpu");
  SHOAL_CHECK_T(InvalidArgument, backend == "auto" || backend == "gloo", "--backend ", backend,
                ": ", flag, " re-forms its groups on gloo only; use --backend gloo (or auto)");
  SHOAL_CHECK_T(InvalidArgument, comm_hook == CommHookKind::kAllreduce && !bucket_cap_mb, flag,
                " reduces the gradients in one allreduce after backward: --comm-hook and "
                "--bucket-cap-mb do not apply");
  SHOAL_CHECK_T(InvalidArgument, options.accumulate == 1, flag,
                " does not go with --accumulate yet (a step is one batch)");
  SHOAL_CHECK_T(InvalidArgument, options.precision == Precision::kFp32, flag,
                " does not go with --precision ", precision_name(options.precision), " yet; use fp32");
  SHOAL_CHECK_T(InvalidArgument, min_replicas >= 1, "--min-replicas ", min_replicas,
                " must be at least 1");
}

int StrategySpec::replica_count() const {
  if (replicas > 0) return replicas;
  return kind == StrategyKind::kDp ? 2 : 1;
}

bool StrategySpec::runs_as_job() const {
  return !mesh.empty() || kind == StrategyKind::kDdp || kind == StrategyKind::kFsdp ||
         kind == StrategyKind::kPs ||
         kind == StrategyKind::kPipeline;
}

int StrategySpec::local_processes() const {
  if (!mesh.empty()) return mesh_ranks(mesh);
  if (kind == StrategyKind::kDdp || kind == StrategyKind::kFsdp) return nproc_per_node;
  if (kind == StrategyKind::kPipeline) return stages * replica_count();
  return 1;
}

launcher::LaunchOptions StrategySpec::launch_options(std::vector<std::string> command) const {
  SHOAL_CHECK_T(InvalidArgument, runs_as_job(), "--strategy ", strategy_name(kind),
                " runs in one process; it launches no job");
  launcher::LaunchOptions launch =
      kind == StrategyKind::kPs
          ? launcher::LaunchOptions::parameter_server(workers, servers, std::move(command))
          : launcher::LaunchOptions::workers(local_processes(), std::move(command));
  launch.master_port = 0;  // a free port: jobs may run side by side
  if (kind == StrategyKind::kPs) {
    launch.tolerate_worker_failures = consistency != "bsp";  // asp/ssp go on without a dead worker
  } else {
    launch.max_restarts = max_restarts;
    // The survivors go on without a dead rank; the launcher serves the store so that any may die.
    launch.fault_tolerant = fault_tolerant;
  }
  return launch;
}

namespace {

// --strategy ddp's strategy: model-parallel replicas, periodic sync (--sync) or DDP itself.
std::unique_ptr<Strategy> ddp_strategy_for(const StrategySpec& spec, const comm::InitOptions& init) {
  if (spec.model_parallel > 1) {
    return std::make_unique<ModelParallelDdpStrategy>(spec.model_parallel, init);
  }
  if (spec.fault_tolerant) {
    parallel::FaultTolerantOptions options;
    options.min_replicas = spec.min_replicas;
    options.timeout = comm::timeout_from_env(options.timeout);
    return std::make_unique<FaultTolerantDdpStrategy>(options);
  }
  if (spec.sync != SyncKind::kEveryStep) {
    return std::make_unique<LocalSgdStrategy>(
        LocalSgdOptions{spec.sync, spec.sync_every, spec.outer_lr, spec.outer_momentum}, init);
  }
  auto ddp = std::make_unique<DdpStrategy>(init);
  std::shared_ptr<parallel::PowerSGDState> power_sgd;
  if (spec.comm_hook == CommHookKind::kPowerSgd) {
    power_sgd = std::make_shared<parallel::PowerSGDState>();
    power_sgd->matrix_approximation_rank = spec.powersgd_rank;
    power_sgd->start_powerSGD_iter = spec.powersgd_start_iter;
  }
  ddp->set_comm_hook(spec.comm_hook, power_sgd);
  ddp->set_bucket_cap_mb(
      spec.bucket_cap_mb.value_or(parallel::DistributedDataParallelOptions{}.bucket_cap_mb));
  return ddp;
}

}  // namespace

std::unique_ptr<Strategy> StrategySpec::make_strategy(const TrainOptions& options) const {
  comm::InitOptions init;
  init.backend = backend;
  if (!mesh.empty()) return std::make_unique<TpStrategy>(comm::parse_mesh(mesh), init);
  switch (kind) {
    case StrategyKind::kSingle:
      return std::make_unique<SingleProcess>();
    case StrategyKind::kDp:
      // One intra-op thread per replica slot (DataParallelOptions' default).
      return std::make_unique<DataParallelStrategy>(replica_count(), options.model);
    case StrategyKind::kPs:
      return std::make_unique<PsStrategy>();
    case StrategyKind::kFsdp:
      return std::make_unique<FsdpStrategy>(shard, init);
    case StrategyKind::kPipeline: {
      PipelineStrategyOptions pipe;
      pipe.stages = stages;
      pipe.pipeline.micro_batches = micro_batches;
      pipe.pipeline.schedule = pipeline::schedule_from_string(schedule);
      pipe.pipeline.recompute = recompute;
      return std::make_unique<PipelineStrategy>(pipe, init);
    }
    case StrategyKind::kDdp:
      break;
  }
  return ddp_strategy_for(*this, init);
}

}  // namespace shoal::train
