// LocalSGD and DiLoCo: data parallelism for slow links. Each replica steps its own optimizer on
// its own gradients (no gradient allreduce); every `sync_every` optimizer steps the replicas
// synchronise with one allreduce of the parameters' size. The semantics are torchft's
// (torchft.local_sgd.LocalSGD and DiLoCo with one fragment), without its fault tolerance:
//
// - LocalSGD (Lin et al., "Don't use large mini-batches, use local SGD"): at a sync every
//   parameter becomes its average over the replicas.
// - DiLoCo (Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language
//   Models"): a copy of the global parameters is kept. At a sync the pseudo-gradient
//   global - local is averaged over the replicas, the module's parameters are reset to the global
//   copy, the averaged pseudo-gradient is set as their .grad, and the outer optimizer (built over
//   the module's parameters; the paper's is Nesterov SGD, lr 0.7, momentum 0.9) steps them; the
//   result is the new global copy and every replica's parameters. The inner optimizer's state
//   (AdamW's moments) carries on across syncs.
//
// Buffers (BatchNorm's running statistics) are left as torchft leaves them: never averaged, each
// replica keeps its own after the first step. The constructor copies rank 0's parameters and
// buffers to every rank (as DistributedDataParallel does), so that the replicas start equal;
// torchft gets that from its Manager's recovery instead.
//
// LibTorch's optimizers have no step hooks: call step() after each optimizer.step(), where torchft
// registers its optimizer post-hook.
//
// Thread safety: one thread per rank drives an instance; step() and sync() are collectives every
// rank calls the same number of times, in the same order as its other collectives.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace shoal::comm {
class ProcessGroup;
}

namespace torch::optim {
class Optimizer;
}

namespace shoal::parallel {

/// Parameter averaging every `sync_every` optimizer steps (see the file comment).
class LocalSGD {
 public:
  /// Copies rank 0's parameters and buffers to every rank of `group` (a collective);
  /// InvalidArgument for sync_every < 1 or replicas whose parameters differ in name or shape.
  LocalSGD(std::shared_ptr<torch::nn::Module> module, std::shared_ptr<comm::ProcessGroup> group,
           int64_t sync_every);
  virtual ~LocalSGD();
  LocalSGD(const LocalSGD&) = delete;
  LocalSGD& operator=(const LocalSGD&) = delete;

  /// Counts one optimizer step; synchronises on the sync_every-th since the last sync. Returns
  /// whether it synchronised.
  bool step();
  /// Synchronises now (all ranks call it) and restarts the count of local steps.
  void sync();

  /// Optimizer steps since the last sync.
  int64_t local_step() const { return local_step_; }
  int64_t sync_every() const { return sync_every_; }
  /// Syncs so far.
  int64_t syncs() const { return syncs_; }
  /// Bytes this rank allreduced so far (one parameter-sized allreduce per sync).
  double bytes_reduced() const { return bytes_reduced_; }

 protected:
  /// What a sync does to the parameters (LocalSGD: average them).
  virtual void perform_sync();
  /// Averages `tensors` over the replicas in place: one allreduce (sum, then / world size, as
  /// torchft's Manager averages) per dtype.
  void average(const std::vector<at::Tensor>& tensors);
  /// The module's parameters, each tensor once, in named_parameters order.
  const std::vector<at::Tensor>& parameters() const { return parameters_; }

 private:
  std::shared_ptr<torch::nn::Module> module_;
  std::shared_ptr<comm::ProcessGroup> group_;
  std::vector<at::Tensor> parameters_;
  int64_t sync_every_;
  int64_t local_step_ = 0;
  int64_t syncs_ = 0;
  double bytes_reduced_ = 0;
};

/// An outer optimizer step on the averaged pseudo-gradient every `sync_every` inner steps (see
/// the file comment).
class DiLoCo : public LocalSGD {
 public:
  /// `inner_optimizer` steps every batch and `outer_optimizer` every sync; both must be built
  /// over the module's parameters (InvalidArgument otherwise) and outlive this object.
  DiLoCo(std::shared_ptr<torch::nn::Module> module, torch::optim::Optimizer& inner_optimizer,
         torch::optim::Optimizer& outer_optimizer, std::shared_ptr<comm::ProcessGroup> group,
         int64_t sync_every);

  /// The global parameters: the outer optimizer's last result (the initial ones before the first
  /// sync), in the order of the module's parameters.
  const std::vector<at::Tensor>& global_parameters() const { return global_; }

 protected:
  void perform_sync() override;

 private:
  torch::optim::Optimizer& outer_;
  std::vector<at::Tensor> global_;
};

}  // namespace shoal::parallel
