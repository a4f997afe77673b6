// FsdpStrategy: sharded data-parallel training for the built-in trainer (`shoal train --strategy
// fsdp --shard 1|2|3`), DdpStrategy's recipe with FullyShardedDataParallel in place of DDP.
//
// prepare() wraps the model in FullyShardedDataParallel at the given ZeRO stage (every
// submodule with parameters of its own becomes a unit: the built-in models' layers) and replaces
// the trainer's optimizer by one of the same kind and options over this rank's shards (SGD,
// Adam and AdamW; the optimizer state is then a shard's). Each rank trains on its
// DistributedSampler shard, so the run equals --strategy ddp's. synchronize() gathers the full parameters into the model
// (before evaluation and saving); checkpoints hold the whole optimizer state, gathered from the
// shards, so they are --strategy ddp's format and resume at any world size, with either strategy
// (a resume gives each rank its shard of the saved state). --accumulate N runs the first N-1
// micro-batches in FSDP's no_sync (one reduction per step), --clip-grad-norm clips to the global
// norm over all shards (FSDP's clip_grad_norm_), and without it the logged grad_norm is that same
// norm (an allreduce of one double on each logged step), --precision bf16 autocasts the forward
// as the other strategies do.
//
// Thread safety: as Strategy; one instance per process, used from the trainer's thread.
#pragma once

#include <memory>

#include <torch/optim/optimizer.h>

#include "shoal/comm/init.h"
#include "shoal/train/strategy.h"

namespace shoal::parallel {
class FullyShardedDataParallel;
}

namespace shoal::train {

/// Sharded data-parallel training over a process group (see the file comment).
class FsdpStrategy : public Strategy {
 public:
  /// `stage`: ZeRO's 1 (optimizer state), 2 (+ gradients) or 3 (+ parameters). Joins the process
  /// group now (so that rank() is known before the data is loaded).
  FsdpStrategy(int stage, const comm::InitOptions& init = {});
  /// Uses an existing process group.
  FsdpStrategy(int stage, std::shared_ptr<comm::ProcessGroup> group);
  ~FsdpStrategy() override;

  std::string name() const override { return "fsdp"; }
  void prepare(TrainState& state) override;
  at::Tensor epoch_indices(int64_t dataset_size, int64_t epoch, uint64_t seed,
                           int64_t consumed) override;
  void all_reduce_sum(std::vector<double>& values) override;
  void synchronize(TrainState& state) override;
  /// FullyShardedDataParallel::clip_grad_norm_: the global norm over every rank's shards.
  double clip_grad_norm(TrainState& state, double max_norm) override;
  /// FullyShardedDataParallel::total_grad_norm: the same global norm, not clipped (the module's
  /// own gradients are empty after the reduction). A collective.
  double grad_norm(TrainState& state) override;
  /// The whole optimizer state gathered from the shards (the optimizer DDP would have), so that
  /// checkpoints of fsdp and ddp are one format and resume at any world size with either.
  torch::optim::Optimizer* checkpoint_optimizer(TrainState& state) override;
  /// This rank's flat-parameter pieces and their optimizer state, nothing gathered
  /// (--checkpoint-format sharded).
  bool sharded_checkpoint(TrainState& state, checkpoint::ShardedTrainingState& out) override;
  int rank() const override;
  int world_size() const override;
  comm::ProcessGroup* process_group() override { return group_.get(); }

  /// The wrapper (after prepare()), for its memory statistics.
  const parallel::FullyShardedDataParallel* fsdp() const { return fsdp_.get(); }

 private:
  int stage_;
  std::shared_ptr<comm::ProcessGroup> group_;
  std::shared_ptr<parallel::FullyShardedDataParallel> fsdp_;
  std::unique_ptr<torch::optim::Optimizer> full_optimizer_;  ///< the last checkpoint_optimizer()
};

}  // namespace shoal::train
