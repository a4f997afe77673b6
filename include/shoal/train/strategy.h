// Where a training strategy plugs into the built-in trainer: how the model is wrapped, which
// samples this process trains on in each epoch, and how numbers are summed across processes.
//
// SingleProcess (the default) trains one model on all samples, shuffled per epoch exactly as
// PyTorch's DistributedSampler with one replica does (randperm with a generator seeded with
// seed + epoch). A data-parallel strategy overrides prepare() to wrap the model (broadcast the
// initial weights, hook gradient averaging), epoch_indices() to hand each rank its shard, and
// all_reduce_sum() so that metrics cover every rank.
//
// Thread safety: a strategy belongs to one trainer and is called from its thread only.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace shoal::comm {
class ProcessGroup;
}

namespace torch::optim {
class Optimizer;
}

namespace shoal::checkpoint {
class CheckpointManager;
struct ShardedTrainingState;
struct TrainingState;
}

namespace shoal::train {

struct TrainState;

/// How a strategy that deals each step's samples when the step starts (fault-tolerant DDP: the
/// members may change between steps) tells the trainer what to train on; the trainer then trains
/// on next_share() instead of epoch_indices().
class StepDealer {
 public:
  virtual ~StepDealer() = default;
  /// Starts `epoch`, whose first `consumed` samples (all ranks together) were trained on before
  /// (a resume).
  virtual void start_epoch(int64_t size, int64_t epoch, uint64_t seed, int64_t consumed) = 0;
  /// This rank's share ([k] int64, k may be 0) of the next step, each rank taking up to `batch`;
  /// nullopt when the epoch is done.
  virtual std::optional<at::Tensor> next_share(int64_t batch) = 0;
  /// After the step's train_step: whether it committed (else it was discarded everywhere).
  virtual bool committed() const = 0;
  /// The epoch's samples consumed by committed steps, all ranks together.
  virtual int64_t consumed() const = 0;
  /// This rank's samples in the epoch's committed steps.
  virtual int64_t trained() const = 0;
};

/// What a strategy's gradient communication cost this process so far (cumulative).
struct CommStats {
  double bytes = 0;         ///< bytes of gradients reduced
  double wait_seconds = 0;  ///< time training was blocked waiting for reductions to finish
  double bucket_cap_mb = 0;  ///< DDP: the bucket_cap_mb in use (0: not DDP)
  bool bucket_cap_tuning = false;  ///< DDP with bucket_cap_mb = auto, still trying candidates
};

/// The hooks a distribution strategy implements; the defaults (all but name()) are single-process
/// training.
class Strategy {
 public:
  virtual ~Strategy() = default;

  /// Called once before the first step. Sets state.forward to what the forward pass goes through
  /// (the default: the model itself; DDP: its wrapper), and state.forward_loss likewise for a
  /// model that computes its own loss (state.model_loss); a strategy that cannot train such a
  /// model leaves forward_loss null and the trainer refuses it.
  virtual void prepare(TrainState& state);

  /// The training-sample indices ([k] int64) this process visits in `epoch` (0-based), in order,
  /// dealt as set_exactly_once() says, from where the job stands in the epoch: `consumed` samples
  /// of the epoch's order (all ranks together; 0 for a new epoch, a checkpoint's samples_seen on a
  /// resume) were trained on before, whatever the world size was then.
  virtual at::Tensor epoch_indices(int64_t dataset_size, int64_t epoch, uint64_t seed,
                                   int64_t consumed);
  /// How epoch_indices() deals: false (the default) pads the ranks' shares to equal sizes as
  /// DistributedSampler does; true deals each sample at most once across the job and drops the
  /// last (size % replicas) of the epoch's order so that every rank takes the same number of steps
  /// (ExactlyOnceSampler with drop_last). The trainer sets it from the training set
  /// (BatchDataset::deal_exactly_once).
  void set_exactly_once(bool exactly_once) { exactly_once_ = exactly_once; }
  bool exactly_once() const { return exactly_once_; }

  /// The strategy's per-step dealing, or null (the default) when epoch_indices() deals the epoch.
  virtual StepDealer* step_dealer() { return nullptr; }

  /// Sums `values` element-wise across processes, in place (identity in one process).
  virtual void all_reduce_sum(std::vector<double>& values) {}

  /// This process's rank and the number of processes; only rank 0 reports progress and metrics.
  virtual int rank() const { return 0; }
  virtual int world_size() const { return 1; }

  /// The process group checkpoints are saved through (rank 0 writes, all wait); null alone.
  virtual comm::ProcessGroup* process_group() { return nullptr; }

  /// Saves a whole (not sharded) checkpoint through `checkpoints`, called by every process: the
  /// default lets rank 0 of process_group() write while the others wait (CheckpointManager::save).
  /// A fault-tolerant strategy outlives a writer that dies inside the save.
  virtual void save_checkpoint(checkpoint::CheckpointManager& checkpoints,
                               const checkpoint::TrainingState& state);

  /// One optimizer step on a batch; returns the batch's mean loss (the default: train_step()).
  virtual double train_step(TrainState& state, const at::Tensor& inputs, const at::Tensor& targets);

  /// Makes state.model and the optimizer's state the whole trained model on every process; the
  /// trainer calls it before evaluating, before saving a checkpoint and when a fit stops inside
  /// an epoch. Needed when processes
  /// train parts of the model (pipeline stages); the default does nothing.
  virtual void synchronize(TrainState& state) {}

  /// The optimizer a checkpoint captures: state.optimizer (the default), or where the strategy
  /// shards its state, a whole one gathered for the occasion (FSDP; then a collective, called by
  /// every process after synchronize()). Valid until the next call.
  virtual torch::optim::Optimizer* checkpoint_optimizer(TrainState& state);

  /// `shoal train --checkpoint-format sharded`: fills `out` with this process's piece of the
  /// parameters and optimizer state and the layout of the pieces (the training metadata is the
  /// trainer's), without gathering anything; returns false when the strategy does not shard
  /// (the default), and the trainer then refuses the format. Called by every process.
  virtual bool sharded_checkpoint(TrainState& state, checkpoint::ShardedTrainingState& out);

  /// clip_grad_norm_ over the global norm of the gradients of the whole model, after a
  /// backward (and DDP's averaging); returns the norm before clipping. The default clips
  /// state.model's parameters; strategies whose processes hold parts of the model sum across
  /// them.
  virtual double clip_grad_norm(TrainState& state, double max_norm);

  /// The total L2 norm of the gradients of the whole model after a step, not clipped: the
  /// grad_norm the trainer logs when it does not clip. The default takes state.model's
  /// parameters' gradients; FSDP's live in each rank's shards, so its norm is a collective, and
  /// the trainer calls it on every process at the same (logged) steps.
  virtual double grad_norm(TrainState& state);

  /// How many processes train on the same samples (the stages of one pipeline): the trainer
  /// divides its sample counts and summed training metrics by it. 1 for data parallelism.
  virtual int ranks_per_replica() const { return 1; }

  /// The name `shoal train --strategy` gives it ("single", "ddp", ...): metrics and TensorBoard
  /// name runs by it. No default, so that a new strategy cannot be labelled as another.
  virtual std::string name() const = 0;

  /// The gradient communication so far, for metrics; nullopt when the strategy does not
  /// measure it (or does not communicate).
  virtual std::optional<CommStats> comm_stats() const { return std::nullopt; }

  /// What the run's header line adds about this strategy's settings (empty: nothing).
  virtual std::string describe() const { return ""; }

  /// Whether it can train on a CUDA device: single and plain DDP can; the others keep their
  /// models, buffers and messages on the CPU.
  virtual bool trains_on_gpu() const { return false; }

 private:
  bool exactly_once_ = false;
};

/// Plain single-process training: the defaults of Strategy.
class SingleProcess : public Strategy {
 public:
  std::string name() const override { return "single"; }
  bool trains_on_gpu() const override { return true; }
};

/// The rule between the device and the strategy, for StrategySpec::validate and the Trainer:
/// InvalidArgument unless `device` is "cpu" or the strategy `trains_on_gpu`. `strategy` names it
/// in the message ("ps", "ddp with --model-parallel").
void check_strategy_device(const std::string& device, bool trains_on_gpu,
                           const std::string& strategy);

/// This replica's DistributedSampler shard of `epoch` (shuffled with `seed`, padded to equal
/// shares), as [k] int64: what data-parallel strategies train on. With `exactly_once`, its
/// ExactlyOnceSampler share instead (drop_last: equal shares, no sample twice).
///
/// `consumed` > 0 (a resume) deals only the rest of the epoch's order, order[consumed:], over
/// `replicas`, as the sampler deals a whole epoch: padded as DistributedSampler pads (repeating
/// the order from its start) or, with `exactly_once`, cut to a multiple of `replicas`. So every
/// sample of the rest is trained once whatever the world size that consumed the first part; at
/// that same world size the shard is the tail of the uninterrupted one.
at::Tensor sampler_indices(int64_t dataset_size, int64_t epoch, uint64_t seed, int replica,
                           int replicas, bool exactly_once = false, int64_t consumed = 0);

/// Sums `values` element-wise across `group`, in place.
void all_reduce_sum(comm::ProcessGroup& group, std::vector<double>& values);

/// randperm(size) drawn from a generator seeded with seed + epoch: the permutation PyTorch's
/// DistributedSampler(shuffle=True, seed=seed) produces after set_epoch(epoch).
at::Tensor shuffled_indices(int64_t size, uint64_t seed, int64_t epoch);

}  // namespace shoal::train
