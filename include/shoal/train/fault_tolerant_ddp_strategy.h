// FaultTolerantDdpStrategy: `shoal train --strategy ddp --fault-tolerant`, data parallelism that
// keeps training when a rank dies, without a restart (parallel::FaultTolerantManager).
//
// Each step: the manager's quorum (the group is re-formed after a failed step), this rank's share
// of the step's samples (see below), forward and backward on the model itself (no DDP reducer),
// one allreduce of the flat gradients weighted by each rank's sample count, the commit vote, and
// the optimizer step only when every replica's reduction succeeded. A failed step is discarded by
// every survivor (no half-reduced gradient is applied; their weights stay bit-identical) and its
// samples are dealt again in the next step.
//
// Data. The epoch's global order is shuffled_indices(size, seed, epoch), the same on every rank;
// the committed steps consume a prefix of it. A step deals the next members x batch samples of
// the order as contiguous slices, the i-th member (in job-rank order) taking the i-th; the last
// step splits what is left as evenly as possible. So after a failure the rest of the epoch is
// dealt over the survivors, and every sample is trained on exactly once per epoch.
//
// A replacement (`shoal run --max-restarts`, see FaultTolerantManager) is admitted at a training
// step's start: the donor sends it the parameters, buffers, optimizer state, torch's RNG state and
// the position in the epoch, so that it trains the rest of the epoch with the others from
// bit-identical weights and optimizer state.
//
// Not supported (refused by StrategySpec::validate): gradient accumulation, fp16 and bf16
// (autocast), CUDA, --sync, --model-parallel, --mesh. Buffers (BatchNorm's running statistics)
// are rank 0's at the start and each rank's own afterwards.
//
// Checkpoints. Replica 0 writes; whether it did reaches the others through the manager, as a
// step's reduction does, so that a writer dying inside the save fails only that reduction: the
// survivors re-form and the new replica 0 saves again (the file is written under a temporary
// name and renamed once whole, so the dead writer's part is never taken for a checkpoint). Not
// covered: a writer stopped (not killed) inside the save and continued after the survivors saved
// again still renames its file, of the same step, into place and points "latest" at it.
//
// SHOAL_FT_SAMPLE_LOG=PATH appends to PATH.rank<job rank>, for each step this rank trains,
// "T epoch generation attempt id id ..." (its share) before the vote and "C generation attempt"
// once the step committed: what the tests count samples with (a rank killed after its step
// committed but before it wrote "C" is covered by the others' "C" lines).
//
// Thread safety: as Strategy; one instance per process, used from the trainer's thread.
#pragma once

#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "shoal/parallel/fault_tolerant_manager.h"
#include "shoal/train/strategy.h"

namespace shoal::checkpoint {
struct OptimizerState;
}

namespace shoal::train {

class FaultTolerantDdpStrategy : public Strategy, public StepDealer {
 public:
  /// Joins the job through its store: rank 0's at MASTER_ADDR:MASTER_PORT, or the launcher's
  /// when SHOAL_FT_AGENT_STORE=1 (`shoal run` with fault tolerance serves it).
  explicit FaultTolerantDdpStrategy(parallel::FaultTolerantOptions options);
  /// Uses a manager made by the caller (tests).
  explicit FaultTolerantDdpStrategy(std::unique_ptr<parallel::FaultTolerantManager> manager);
  ~FaultTolerantDdpStrategy() override;

  void prepare(TrainState& state) override;
  double train_step(TrainState& state, const at::Tensor& inputs,
                    const at::Tensor& targets) override;
  StepDealer* step_dealer() override { return this; }
  void all_reduce_sum(std::vector<double>& values) override;
  int rank() const override;
  int world_size() const override;
  comm::ProcessGroup* process_group() override;
  void save_checkpoint(checkpoint::CheckpointManager& checkpoints,
                       const checkpoint::TrainingState& state) override;
  std::string name() const override { return "ddp"; }
  std::string describe() const override;

  void start_epoch(int64_t size, int64_t epoch, uint64_t seed, int64_t consumed) override;
  std::optional<at::Tensor> next_share(int64_t batch) override;
  bool committed() const override { return committed_; }
  int64_t consumed() const override { return consumed_; }
  int64_t trained() const override { return trained_; }

  const parallel::FaultTolerantManager& manager() const { return *manager_; }

 private:
  /// Sets each parameter's gradient from the allreduced [weighted gradients..., samples].
  void set_mean_gradients(const at::Tensor& sums);
  /// Sends this replica's state to the replicas that just joined, or receives it (see .cpp).
  void share_state(TrainState& state);
  void adopt_state(TrainState& state, const checkpoint::OptimizerState& optimizer,
                   const at::Tensor& rng, const at::Tensor& header);
  void log_share(const std::string& attempt);
  void log_line(const std::string& line);

  std::unique_ptr<parallel::FaultTolerantManager> manager_;
  std::vector<at::Tensor> parameters_;
  at::Tensor order_;        // the epoch's global order
  int64_t epoch_ = 0;
  int64_t consumed_ = 0;    // of order_, by committed steps
  int64_t step_take_ = 0;   // of order_, by the step in flight (all members)
  at::Tensor share_;        // this rank's share of the step in flight
  bool committed_ = false;
  int64_t trained_ = 0;     // samples this rank trained on in committed steps of the epoch
  std::unique_ptr<std::ofstream> sample_log_;
  TrainState* state_ = nullptr;  // prepare()'s: the state sent to replacements
  int64_t joined_epoch_ = -1;    // a replacement: the epoch it joined in, and where in it
  int64_t joined_consumed_ = 0;
};

}  // namespace shoal::train
