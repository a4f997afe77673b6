// Pipeline: one stage of a pipeline-parallel model, run by one rank (PyTorch's PipelineStage with
// its ScheduleGPipe / Schedule1F1B).
//
//   auto model = torch::nn::Sequential(...);                     // the same on every rank
//   auto balance = shoal::pipeline::balance_by_parameters(model, K);
//   shoal::pipeline::Pipeline pipe(shoal::pipeline::stage_module(model, balance, rank), pg,
//                                  {0, 1, ..., K-1}, {.micro_batches = 4});
//   torch::optim::SGD sgd(pipe.module()->parameters(), 0.1);    // this stage's parameters only
//   sgd.zero_grad();
//   double loss = pipe.forward_backward(x, y, cross_entropy);    // x read on stage 0, y on K-1
//   sgd.step();
//
// forward_backward() splits the batch into micro-batches (tensor_split along dim 0: sizes differ
// by at most one), runs this stage's schedule (see schedule.h), and sends activations forward and
// their gradients back to the neighbouring stages with the process group's send/recv. The last
// stage computes each micro-batch's loss scaled by its share of the batch's loss terms (n_i / N:
// its samples by default; a language model's counted tokens, see LossTerms), so the accumulated
// gradients equal those of one backward on the whole batch's mean loss, and the optimizer step
// after forward_backward is the full-batch step.
//
// Every tensor travels after a small fixed-size header (kind, step, micro-batch, dtype, shape),
// which the receiver checks and bounds (PipelineOptions::max_message_bytes) before it allocates.
// A stage that fails (its layers throw, a neighbour's message is wrong, a neighbour died or timed
// out) sends an error header naming itself to both neighbours, aborts the process group (on shm
// that fails every rank's pending operation at once) and throws; a stage that receives an error
// header passes it on to its other neighbour and throws too, so every rank fails with a message
// naming the stage and rank where the failure began.
//
// Data parallel (a K x R grid, see PipelineGrid): give the stage a DistributedDataParallel over
// the stage's replicas with set_data_parallel(); every backward but the last of a step runs under
// no_sync(), so DDP averages the accumulated gradients once per step.
//
// Thread safety: one thread drives a Pipeline. Stages of one pipeline may be threads of one
// process (tests) or processes.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "shoal/comm/process_group.h"
#include "shoal/pipeline/schedule.h"

namespace shoal::parallel {
class DistributedDataParallelBase;
}

namespace shoal::pipeline {

class StageTransport;

struct PipelineOptions {
  /// Micro-batches per step (PyTorch Pipe's `chunks`). More micro-batches shrink the idle bubble,
  /// (K-1)/(M+K-1) of a step, at the cost of smaller (less efficient) matrix products.
  int64_t micro_batches = 1;
  Schedule schedule = Schedule::k1F1B;
  /// Keep only each micro-batch's input during forward and recompute the stage's forward just
  /// before its backward (activation checkpointing): less memory, one more forward per step.
  bool recompute = false;
  /// With recompute: save torch's CPU generator state before each micro-batch's forward and
  /// replay it in the recomputation, then restore the stream (torch.utils.checkpoint's
  /// preserve_rng_state=True), so Dropout draws the forward's masks again. The generator is
  /// process-wide: when stages run as threads of one process, only the stages that draw random
  /// numbers may preserve it (another thread's restore would rewind their stream).
  bool preserve_rng_state = true;
  /// The largest tensor a stage accepts from a neighbour. Headers asking for more are refused
  /// before anything is allocated (a corrupt or hostile header must not exhaust memory).
  int64_t max_message_bytes = int64_t{1} << 32;
  /// Time-out of every send and receive (kGroupTimeout: the group's).
  comm::Milliseconds timeout = comm::kGroupTimeout;
};

/// A micro-batch's loss: the mean over its samples (cross_entropy's default reduction).
using LossFunction = std::function<at::Tensor(const at::Tensor& output, const at::Tensor& target)>;

/// How many terms a micro-batch's mean loss averages, from its targets: their weight in the
/// batch's mean. A micro-batch with none (every target ignored) adds nothing to the loss.
using LossTerms = std::function<int64_t(const at::Tensor& target)>;

/// What a stage measured, summed over the steps since the last reset_stats().
struct PipelineStats {
  int64_t steps = 0;
  double step_seconds = 0;     ///< wall time inside forward_backward
  double compute_seconds = 0;  ///< of which running this stage's layers (forward, backward)
  /// Most bytes of layer outputs held for backward at one time (inputs from the neighbour
  /// included; with recompute only the inputs).
  int64_t peak_activation_bytes = 0;
  int64_t peak_in_flight = 0;  ///< most micro-batches between forward and backward at one time
  /// Fraction of the step this stage waited: 1 - compute / step.
  double idle_fraction() const {
    return step_seconds > 0 ? 1.0 - compute_seconds / step_seconds : 0.0;
  }
};

class Pipeline {
 public:
  /// `stage`: this rank's layers. `stage_ranks[s]` is the rank in `group` of stage s; this rank
  /// must be one of them (its index is this stage's number).
  Pipeline(torch::nn::Sequential stage, std::shared_ptr<comm::ProcessGroup> group,
           std::vector<int> stage_ranks, PipelineOptions options = {});
  ~Pipeline();
  Pipeline(const Pipeline&) = delete;
  Pipeline& operator=(const Pipeline&) = delete;

  int stage() const { return stage_; }
  int num_stages() const { return static_cast<int>(stage_ranks_.size()); }
  bool is_first_stage() const { return stage_ == 0; }
  bool is_last_stage() const { return stage_ == num_stages() - 1; }
  const torch::nn::Sequential& module() const { return module_; }
  const PipelineOptions& options() const { return options_; }
  const std::shared_ptr<comm::ProcessGroup>& process_group() const { return group_; }

  /// Averages this stage's gradients across its data-parallel replicas once per step (see the
  /// file comment). `ddp` wraps module() over the group of this stage's replicas.
  void set_data_parallel(std::shared_ptr<parallel::DistributedDataParallelBase> ddp);

  /// One step's forward and backward passes (see the file comment). `inputs` [N, ...] is read on
  /// the first stage, `targets` [N, ...] and `loss` on the last; other stages may pass undefined
  /// tensors. Gradients accumulate into the stage's parameters' .grad (zero them before).
  /// `terms` (last stage; null: one per sample) weighs the micro-batches' losses.
  /// Returns the batch's mean loss on the last stage, NaN on the others.
  double forward_backward(const at::Tensor& inputs, const at::Tensor& targets,
                          const LossFunction& loss, const LossTerms& terms = nullptr);

  PipelineStats stats() const { return stats_; }
  void reset_stats() { stats_ = {}; }

  /// "pipeline stage 1 (rank 1) of 3".
  std::string describe() const;

 private:
  struct MicroBatch;

  void run_forward(MicroBatch& mb, const LossFunction& loss);
  void run_backward(MicroBatch& mb, const LossFunction& loss, bool sync);
  at::Tensor run_layers(const at::Tensor& input, int64_t* activation_bytes);
  /// The last stage's output for the micro-batch: its loss times its share of the batch.
  static at::Tensor scaled_loss(const at::Tensor& output, const MicroBatch& mb,
                                const LossFunction& loss);
  /// Cuts the last stage's targets into the micro-batches, with each one's share of the batch.
  void split_targets(const at::Tensor& targets, const LossTerms& terms,
                     std::vector<MicroBatch>& mbs) const;
  [[noreturn]] void fail(std::exception_ptr error, const std::string& during);

  torch::nn::Sequential module_;
  std::shared_ptr<comm::ProcessGroup> group_;
  std::vector<int> stage_ranks_;
  PipelineOptions options_;
  int stage_ = 0;
  std::unique_ptr<StageTransport> transport_;
  std::shared_ptr<parallel::DistributedDataParallelBase> ddp_;
  int64_t step_ = 0;
  int64_t live_activation_bytes_ = 0;
  int64_t live_micro_batches_ = 0;
  PipelineStats stats_;
};

}  // namespace shoal::pipeline
