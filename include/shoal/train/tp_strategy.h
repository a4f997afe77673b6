// TpStrategy: tensor parallelism, with data parallelism across the TP groups, for the built-in
// trainer (`shoal train --model gpt --mesh dp=2,tp=2`).
//
// The job's ranks form a DeviceMesh of the --mesh dimensions ("tp", and "dp", default 1). prepare()
// builds a copy of the model split over the tp group by the model's own plan (Model::parallelize;
// the GPT's: heads, MLP width and vocabulary split, the loss vocabulary-parallel), wraps it in DDP over the dp group when dp > 1,
// and replaces the trainer's optimizer by one of its kind over the copy's parameters. The ranks of
// a tp group train on the same samples, each dp replica on its DistributedSampler shard, so the
// run equals --strategy ddp over dp processes. The trainer's model holds its split layers only
// from synchronize(), which gathers the shards into it (before evaluation and saving), to the
// next training step, which frees them again (so does prepare()): between them a rank holds
// about 1/tp of the split layers' parameters. Checkpoints hold the whole model
// and the whole optimizer state (full format: torch.load reads them, --strategy ddp resumes them,
// and so does --mesh at any tp degree: prepare() cuts the resumed state to this rank's pieces).
//
// Thread safety: as Strategy; one instance per process, used from the trainer's thread.
#pragma once

#include <torch/optim/optimizer.h>

#include <memory>
#include <string>
#include <vector>

#include "shoal/comm/device_mesh.h"
#include "shoal/comm/init.h"
#include "shoal/train/strategy.h"

namespace shoal::models {
class Model;
}

namespace shoal::parallel {
class DistributedDataParallelBase;
class TensorParallelLayout;
}  // namespace shoal::parallel

namespace shoal::train {

/// Tensor x data parallelism over a device mesh (see the file comment).
class TpStrategy : public Strategy {
 public:
  /// `mesh`: "tp" and optionally "dp" (comm::parse_mesh). Joins the process group now;
  /// InvalidArgument when the mesh's ranks are not the job's.
  TpStrategy(std::vector<comm::MeshDimension> mesh, const comm::InitOptions& init = {});
  TpStrategy(std::vector<comm::MeshDimension> mesh, std::shared_ptr<comm::ProcessGroup> group);
  ~TpStrategy() override;

  std::string name() const override { return "tp"; }
  std::string describe() const override;
  void prepare(TrainState& state) override;
  at::Tensor epoch_indices(int64_t dataset_size, int64_t epoch, uint64_t seed,
                           int64_t consumed) override;
  void all_reduce_sum(std::vector<double>& values) override;
  void synchronize(TrainState& state) override;
  /// The whole optimizer state, gathered from the shards (a collective).
  torch::optim::Optimizer* checkpoint_optimizer(TrainState& state) override;
  /// The global gradient norm: the split parameters' squares summed over the tp group.
  double grad_norm(TrainState& state) override;
  /// clip_grad_norm_ over that global norm, scaling this rank's gradients.
  double clip_grad_norm(TrainState& state, double max_norm) override;
  int ranks_per_replica() const override;
  int rank() const override;
  int world_size() const override;
  comm::ProcessGroup* process_group() override { return group_.get(); }

 private:
  /// The trainer's optimizer state (a resumed checkpoint's) into the split optimizer.
  void load_whole_optimizer(TrainState& state);
  /// Frees the trainer's model's split-layer parameters (empty tensors in their place) and the
  /// whole optimizer state, unless already free.
  void release_whole();

  std::shared_ptr<comm::ProcessGroup> group_;
  comm::DeviceMesh mesh_;
  std::shared_ptr<models::Model> split_;  ///< the model this rank trains: its shards
  std::unique_ptr<parallel::TensorParallelLayout> layout_;
  std::shared_ptr<parallel::DistributedDataParallelBase> ddp_;
  torch::optim::Optimizer* whole_optimizer_ = nullptr;  ///< the trainer's first, over its model
  std::unique_ptr<torch::optim::Optimizer> kept_optimizer_;  ///< owns it once replaced
  std::shared_ptr<torch::nn::Module> whole_model_;  ///< the trainer's model
  bool whole_held_ = true;  ///< whether whole_model_'s split layers hold their tensors
};

}  // namespace shoal::train
