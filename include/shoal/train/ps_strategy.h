// PsStrategy: the built-in trainer as a parameter-server worker.
//
// prepare() connects a ps::Worker to the job's servers (ps::job_from_env() under `shoal run
// --num-servers S` / `shoal train --strategy ps`, or the endpoints given), sends rank 0's initial
// weights, pulls them, and replaces the trainer's optimizer with one whose step() pushes the
// gradients and pulls the parameters (the servers own the optimizer and its state). Each worker
// trains on its DistributedSampler shard, as under DDP, so with bsp W workers x batch b is
// single-process training with batch W*b. Metrics are summed through server 0.
//
// Thread safety: as Strategy.
#pragma once

#include <memory>

#include "shoal/ps/job.h"
#include "shoal/ps/worker.h"
#include "shoal/train/strategy.h"

namespace shoal::train {

class PsStrategy : public Strategy {
 public:
  std::string name() const override { return "ps"; }
  /// A worker of the job in the environment (ps::job_from_env()).
  PsStrategy();
  /// A worker with explicit options (servers, rank, num_workers set).
  explicit PsStrategy(ps::WorkerOptions options);
  ~PsStrategy() override;

  void prepare(TrainState& state) override;
  at::Tensor epoch_indices(int64_t dataset_size, int64_t epoch, uint64_t seed,
                           int64_t consumed) override;
  void all_reduce_sum(std::vector<double>& values) override;
  /// Before evaluating or saving: waits until every worker has pushed its last step, then pulls,
  /// so that under asp/ssp a worker that finished first evaluates the final weights too.
  void synchronize(TrainState& state) override;
  int rank() const override { return options_.rank; }
  int world_size() const override { return options_.num_workers; }

  /// The connected worker (after prepare()).
  ps::Worker* worker() { return worker_.get(); }

 private:
  ps::WorkerOptions options_;
  std::unique_ptr<ps::Worker> worker_;
};

}  // namespace shoal::train
