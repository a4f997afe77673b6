// PipelineStrategy: pipeline-parallel training for the built-in trainer, optionally combined with
// data parallelism (a grid of K stages x R replicas, launched as K x R processes).
//
// prepare() views the model as a Sequential (pipeline::as_sequential), splits it into K stages
// (balanced by parameter count unless a balance is given), and runs this rank's stage in a
// pipeline::Pipeline over the job's process group; with R > 1 replicas, each stage's gradients
// are averaged across its replicas by DistributedDataParallel over the stage's sub-group. The
// stages of a replica train on the same samples: the replica's DistributedSampler shard (R shards,
// as DDP with R ranks), so with B samples per step the global batch is R x B.
//
// A model that computes its own loss (the GPT) gives the last stage its loss on the chain's
// output (models::Model::sequential_loss), micro-batches weighted by their loss terms (tokens).
// A parameter that two stages use (the GPT's token embedding, tied to its head on the last stage)
// is one copy per stage, kept equal by summing their gradients after each backward
// (pipeline::TiedParameters), as Megatron-LM does.
//
// Every rank keeps the whole model but trains its stage's layers only; synchronize() (before
// evaluation and checkpoints) copies every stage's weights and optimizer state to every rank, so
// evaluation runs on each rank's share of the test set and a checkpoint is one ordinary state
// dict, resumable by any strategy (see pipeline_checkpoint.h).
//
// Thread safety: as Strategy; one instance per process, used from the trainer's thread.
#pragma once

#include <memory>
#include <vector>

#include "shoal/comm/init.h"
#include "shoal/pipeline/pipeline.h"
#include "shoal/train/clip_grad.h"
#include "shoal/train/strategy.h"

namespace shoal::pipeline {
class PipelineGrid;
class TiedParameters;
}
namespace shoal::parallel {
class DistributedDataParallelBase;
}
namespace shoal::models {
class Model;
}

namespace shoal::train {

struct PipelineStrategyOptions {
  /// Pipeline stages K; the world size must be K x replicas.
  int stages = 2;
  /// Layers per stage (empty: balanced by parameter count).
  std::vector<int64_t> balance;
  /// Micro-batches, schedule, recomputation.
  pipeline::PipelineOptions pipeline;
};

class PipelineStrategy : public Strategy {
 public:
  std::string name() const override { return "pipeline"; }
  /// Joins the process group now (init_process_group).
  explicit PipelineStrategy(PipelineStrategyOptions options, const comm::InitOptions& init = {});
  /// Uses an existing process group (tests).
  PipelineStrategy(PipelineStrategyOptions options, std::shared_ptr<comm::ProcessGroup> group);
  ~PipelineStrategy() override;

  void prepare(TrainState& state) override;
  at::Tensor epoch_indices(int64_t dataset_size, int64_t epoch, uint64_t seed,
                           int64_t consumed) override;
  void all_reduce_sum(std::vector<double>& values) override;
  int rank() const override;
  int world_size() const override;
  comm::ProcessGroup* process_group() override { return group_.get(); }
  double train_step(TrainState& state, const at::Tensor& inputs, const at::Tensor& targets) override;
  /// clip_grad_norm_ over the global norm: every stage's gradients, summed over all ranks.
  double clip_grad_norm(TrainState& state, double max_norm) override;
  /// That same global norm, not clipped (total_grad_norm): the grad_norm the trainer logs without
  /// --clip-grad-norm. A collective: every rank calls it at the same steps.
  double grad_norm(TrainState& state) override;
  void synchronize(TrainState& state) override;
  int ranks_per_replica() const override { return options_.stages; }

  /// This rank's stage (after prepare()).
  const pipeline::Pipeline& pipeline() const { return *pipeline_; }
  const pipeline::PipelineGrid& grid() const { return *grid_; }

 private:
  /// Sums across every rank of the job: the sum_across of the global gradient norm.
  SumAcross sum_across_ranks();
  /// The last stage's loss: the trainer's, or the model's own on its chain (sets forward_loss).
  void choose_loss(models::Model& model, TrainState& state);

  PipelineStrategyOptions options_;
  std::shared_ptr<comm::ProcessGroup> group_;
  std::unique_ptr<pipeline::PipelineGrid> grid_;
  torch::nn::Sequential sequential_{nullptr};
  std::vector<int64_t> balance_;
  std::unique_ptr<pipeline::Pipeline> pipeline_;
  std::shared_ptr<parallel::DistributedDataParallelBase> ddp_;
  std::unique_ptr<pipeline::TiedParameters> tied_;
  /// The last stage's loss on the chain's output, and its micro-batches' weights (null: samples).
  pipeline::LossFunction loss_;
  pipeline::LossTerms loss_terms_;
};

}  // namespace shoal::train
