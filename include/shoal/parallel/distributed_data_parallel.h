// DistributedDataParallel: data-parallel training over a ProcessGroup, the C++ counterpart of
// torch.nn.parallel.DistributedDataParallel (which LibTorch's C++ frontend does not have).
//
//   auto ddp = shoal::parallel::DistributedDataParallel(net, pg);  // checks, broadcasts rank 0's state
//   auto loss = torch::nll_loss(ddp.forward(x), y);                // or net->forward + prepare_for_backward
//   loss.backward();                                                // gradients averaged across ranks
//   optimizer.step();
//
// Construction checks that every rank has the same parameters (names, shapes, dtypes) and copies
// rank 0's parameters and buffers to every rank. During backward, a hook on each parameter's
// gradient accumulator copies the gradient into its bucket; a full bucket is reduced
// asynchronously (through the communication hook) while backward goes on; when backward ends,
// DDP waits for every bucket and writes the averaged gradients back as the parameters' `.grad`.
// Buckets hold parameters in reverse registration order (a small first bucket, then
// bucket_cap_mb each) and are rebuilt once from the order gradients arrived in the first
// synchronised backward (without find_unused_parameters), as PyTorch does. Parameters with sparse
// gradients (Embedding with sparse = true) have no bucket: each is averaged when backward ends by
// allgathers of its indices and values.
//
// Collectives DDP issues (in this order, identical on every rank), following PyTorch's rules:
// before forward, [join flags] (inside join()), [bucket rebuild] (once, the first grad-mode forward
// after the first synchronised backward), [buffer broadcast] (only when the previous forward was
// a grad-mode one outside no_sync(); inside join() from the highest rank that still has data);
// during and after a synchronised backward, the bucket reductions, [unused-parameter map] and
// [sparse gradients]. A forward under torch::NoGradGuard or inside no_sync() prepares no
// synchronised backward: evaluation may run on some ranks only, or a different number of times.
// Every rank must run the same number of synchronised steps, except inside a join() scope.
//
// Thread safety: one thread drives a DDP instance (forward, backward, optimizer step). Several
// instances (one per rank) may run on different threads of one process.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "shoal/comm/process_group.h"
#include "shoal/parallel/grad_bucket.h"
#include "shoal/parallel/join.h"
#include "shoal/parallel/no_sync.h"

namespace shoal::parallel {

class Reducer;

/// PyTorch's DistributedDataParallel arguments, with PyTorch's defaults.
struct DistributedDataParallelOptions {
  /// Size of every bucket after the first (MiB). 25 is PyTorch's default: large enough that the
  /// per-collective latency is amortised, small enough that reduction starts early in backward.
  /// kBucketCapAuto: chosen by measurement (see bucket_cap_candidates_mb).
  double bucket_cap_mb = 25.0;
  /// bucket_cap_mb = kBucketCapAuto (`--bucket-cap-mb auto`): after the one-time bucket rebuild,
  /// the synchronised steps that follow try the candidates, each cap C of
  /// bucket_cap_candidates_mb twice: with the first bucket at first_bucket_cap_mb, and with the
  /// first bucket at C too (so a small model can have a single bucket). Candidates that give the
  /// same buckets are tried once. Interleaved: each round tries every candidate once (one
  /// warm-up step, then bucket_cap_tuning_steps timed steps, each timed from the end of one
  /// synchronised backward to the end of the next), for bucket_cap_tuning_rounds rounds; every
  /// rank then takes the candidate with the least median step time (the slowest rank's, one
  /// allreduce) and keeps it, as Horovod's autotuner keeps its fusion-buffer size. Gradients are
  /// averaged exactly as with a fixed cap; only the bucket boundaries move. ReducerStats says
  /// what was tried and chosen.
  static constexpr double kBucketCapAuto = -1.0;
  std::vector<double> bucket_cap_candidates_mb{0.25, 0.5, 1, 2, 5, 10, 25, 50};
  int bucket_cap_tuning_rounds = 3;
  int bucket_cap_tuning_steps = 2;
  /// Size of the first bucket (MiB). Small (PyTorch's 1 MiB) so that the first reduction starts as
  /// soon as the last layers' gradients are ready.
  double first_bucket_cap_mb = 1.0;
  /// Walk the autograd graph after each forward to find parameters that will get no gradient, and
  /// mark them ready so reduction completes. Needed when some parameters are unused on some steps.
  bool find_unused_parameters = false;
  /// PyTorch's static_graph: the set of used parameters and the gradient order are the same every
  /// iteration. The first iteration finds the parameters no rank uses (as find_unused_parameters
  /// does); afterwards they are marked ready each step without a graph walk or an extra
  /// collective, and the buckets are rebuilt once. Works with re-entrant activation checkpointing.
  bool static_graph = false;
  /// Parameters and buffers DDP leaves alone (PyTorch's
  /// _set_params_and_buffers_to_ignore_for_model), by their names in the module: not verified,
  /// broadcast or reduced; their gradients stay local.
  std::vector<std::string> params_and_buffers_to_ignore;
  /// Copy rank 0's buffers (BatchNorm running statistics) to every rank before each forward.
  bool broadcast_buffers = true;
  /// Make each parameter's `.grad` a view into its bucket: no copy in or out, less peak memory.
  /// Without it (plain gradients) and with buckets reduced inline (bucket_reduction, no unused
  /// parameters to find, no debug_detail), each `.grad` is also kept in its bucket's memory, but
  /// as a tensor of its own (not a view: its own storage, detach_() and set_() work): from the
  /// second step autograd accumulates into it and nothing is copied either, while a `.grad` the
  /// caller still holds stays plain: one kept across zero_grad(set_to_none) is moved to memory of
  /// its own (its values intact) before the next step writes the slot, one the caller assigned
  /// and holds receives the result by a copy; register_comm_hook (nothing reduced inline) moves
  /// them out of the buckets. stats().copied_bytes counts what is copied.
  bool gradient_as_bucket_view = false;
  /// How each bucket's allreduce runs beside backward (the default hook; a registered comm hook
  /// decides for itself). kOverlapped: started asynchronously when the bucket fills, reduced by
  /// the backend's thread while backward computes the earlier layers (PyTorch's way; it pays where
  /// a core is spare). kInline: reduced by the autograd hook that fills the bucket, before backward
  /// goes on (async_op = false; shm runs it on the training thread), so no second thread competes
  /// with the ranks' compute for the cores. kAuto: kInline when the ranks on this host times each
  /// one's intra-op threads leave no core of this process's CPU set spare, else kOverlapped.
  enum class BucketReduction { kAuto, kOverlapped, kInline };
  BucketReduction bucket_reduction = BucketReduction::kAuto;
  /// Keep freed CPU memory for reuse (shoal::memory::tune_cpu_allocator): without it, glibc gives
  /// large freed blocks back and every step faults them in again, at a rate that differs from rank
  /// to rank, so the fastest rank waits at each reduction. A process-wide setting.
  bool tune_cpu_allocator = true;
  /// PyTorch's TORCH_DISTRIBUTED_DEBUG=DETAIL for the gradients: before reducing, the ranks
  /// exchange which parameters got a gradient, and when one did not on some rank every rank fails
  /// with the parameters' names and the ranks where each was used and unused (instead of one rank
  /// failing and the others waiting for a reduction that never comes). Buckets are then reduced
  /// after backward instead of during it: slower, for finding the bug. Defaults to
  /// SHOAL_DEBUG=detail in the environment. Every rank must use the same setting.
  bool debug_detail = debug_detail_from_env();

  static bool debug_detail_from_env();
};

/// Whether DistributedDataParallel with `options` on `group` reduces its buckets inline
/// (bucket_reduction; kAuto decided as documented there) for parameters on the CPU or not.
bool reduces_buckets_inline(const DistributedDataParallelOptions& options,
                            const comm::ProcessGroup& group, bool cpu_parameters);

/// A bucket_reduction as a user writes it (`--bucket-reduction`): auto, overlapped or inline.
/// Throws InvalidArgument saying what it takes.
DistributedDataParallelOptions::BucketReduction parse_bucket_reduction(const std::string& text);

/// A bucket_cap_mb as a user writes it (`--bucket-cap-mb`): a positive number of MiB (at most
/// 1e6), or "auto" (DistributedDataParallelOptions::kBucketCapAuto). Throws InvalidArgument
/// saying what it takes.
double parse_bucket_cap_mb(const std::string& text);

/// What the reducer measured, for benchmarks (seconds summed over iterations).
struct ReducerStats {
  uint64_t iterations = 0;          ///< synchronised backward passes
  /// time training was blocked on bucket reductions: at the end of backward (overlapped), or in
  /// the hooks that reduce buckets inline (bucket_reduction)
  double wait_seconds = 0;
  double backward_seconds = 0;      ///< from the first gradient hook to the end of backward
  double reduced_bytes = 0;         ///< bytes of every bucket reduced
  /// of which reduced asynchronously and done when backward ended (overlapped; 0 inline)
  double hidden_bytes = 0;
  /// bytes copied between gradients and buckets, into them and out of them (0 a step once the
  /// gradients live in the buckets: bucket views, or plain gradients reduced inline)
  double copied_bytes = 0;
  /// bytes of gradients autograd computed straight into their bucket slots (new gradients each
  /// step, as with zero_grad(set_to_none): placed there by DDP's CPU allocator, not copied in)
  double computed_in_bucket_bytes = 0;
  std::vector<int64_t> bucket_bytes;  ///< current bucket sizes, in reduction order
  double bucket_cap_mb = 0;           ///< the bucket_cap_mb in use (auto: the candidate now tried)
  double first_bucket_cap_mb = 0;     ///< the first_bucket_cap_mb in use
  bool bucket_cap_auto = false;       ///< bucket_cap_mb = kBucketCapAuto
  /// buckets reduced inline (bucket_reduction, auto decided; never under a registered comm hook)
  bool inline_reduction = false;
  bool bucket_cap_tuning = false;     ///< auto, and not decided yet
  struct BucketCapTrial {
    double first_bucket_cap_mb = 0;
    double bucket_cap_mb = 0;
    double seconds = 0;  ///< median step time, the slowest rank's
    bool operator==(const BucketCapTrial& o) const {
      return first_bucket_cap_mb == o.first_bucket_cap_mb && bucket_cap_mb == o.bucket_cap_mb &&
             seconds == o.seconds;
    }
  };
  /// auto, once decided: each distinct candidate tried (in the order tried) and its median step
  /// time.
  std::vector<BucketCapTrial> bucket_cap_trials;
  bool static_graph = false;          ///< the static_graph option
  int64_t unused_parameters = 0;      ///< unused in the last walk (static_graph: on every rank)
};

class DistributedDataParallelBase;

/// Training with uneven inputs: `auto join = ddp.join(options);` is `Join join({ddp}, options)`
/// (shoal/parallel/join.h; PyTorch's `with ddp.join():`), and DDP is a Joinable that can share a
/// scope with other joinables (`Join join({ddp, optimizer})`). Inside the scope, each forward
/// starts with the join allreduce (when DDP is the first joinable; otherwise DDP allreduces its
/// own flags there), which also carries whether the ranks with data run this forward in grad
/// mode and with a synchronised backward. A rank whose data ran out shadows the other ranks'
/// steps (DDP's main_hook), taking part in their collectives with zero gradients, its own .grad
/// untouched, until every rank has finished. Gradients are averaged over the full world size
/// (PyTorch's divide_by_initial_world_size). Buffers are broadcast from the highest rank that
/// still has data; when every rank has finished (DDP's post_hook), every rank takes the parameters
/// and buffers of the highest rank among the last to finish, so all replicas are equal, as in
/// PyTorch.
///
/// This class is the type-independent part of DistributedDataParallel (see the file comment).
class DistributedDataParallelBase : public Joinable {
 public:
  DistributedDataParallelBase(std::shared_ptr<torch::nn::Module> module,
                              std::shared_ptr<comm::ProcessGroup> group,
                              DistributedDataParallelOptions options = {});
  virtual ~DistributedDataParallelBase();
  DistributedDataParallelBase(const DistributedDataParallelBase&) = delete;
  DistributedDataParallelBase& operator=(const DistributedDataParallelBase&) = delete;

  /// Runs what DDP does before each forward: the join flag, the one-time bucket rebuild, and the
  /// buffer broadcast. forward() calls it; call it yourself when you call the module directly.
  void prepare_for_forward();
  /// Tells DDP the forward's outputs. Needed with find_unused_parameters (walks their graph);
  /// harmless otherwise. forward() calls it.
  void prepare_for_backward(const at::Tensor& output);
  void prepare_for_backward(const std::vector<at::Tensor>& outputs);

  /// Backward passes inside the guard's lifetime accumulate gradients without communicating.
  NoSyncGuard no_sync();
  /// Starts a join scope for uneven inputs over this DDP alone (see Join).
  Join join(JoinOptions options = {});

  // Joinable: DDP's hook shadows the forward's and backward's collectives and ends with the
  // last joiner's model on every rank; it carries two flags (grad mode, synchronised backward).
  std::unique_ptr<JoinHook> join_hook(const JoinOptions& options) override;
  c10::Device join_device() const override;
  std::shared_ptr<comm::ProcessGroup> join_process_group() const override { return group_; }
  size_t join_flag_count() const override { return 2; }

  /// Replaces the default allreduce-and-average with `hook` (PyTorch's register_comm_hook).
  /// Call before the first backward.
  void register_comm_hook(CommHook hook);

  /// The wrapped module's parameters and buffers, with the module's own names (no "module." prefix:
  /// a checkpoint of ddp and of the module are interchangeable). A tensor registered under two
  /// names (tied weights) is listed, broadcast and reduced once, under its first name.
  torch::OrderedDict<std::string, at::Tensor> named_parameters() const;
  torch::OrderedDict<std::string, at::Tensor> named_buffers() const;
  std::vector<at::Tensor> parameters() const;

  const std::shared_ptr<comm::ProcessGroup>& process_group() const { return group_; }
  const DistributedDataParallelOptions& options() const { return options_; }
  ReducerStats stats() const;

 protected:
  /// forward() returned something other than tensors: fine unless find_unused_parameters is set.
  void prepare_for_backward_opaque();

  std::shared_ptr<torch::nn::Module> base_module_;

 private:
  friend class DdpJoinHook;
  /// What the join allreduce says about the ranks with data at this step.
  struct JoinFlags {
    int active_ranks = 0;  ///< ranks that still have data
    bool grad_mode = false;  ///< some active rank runs this forward in grad mode
    bool sync = false;       ///< some active rank's backward is synchronised
  };
  /// Whether this forward broadcasts buffers (PyTorch's will_sync_module_buffers).
  bool will_sync_buffers() const;
  void broadcast_buffers(bool has_data);
  /// The highest rank for which `candidate` is true (an allreduce of every rank's vote).
  int find_common_rank(bool candidate);
  /// End of join: every rank takes the parameters and buffers of the highest last joiner.
  void sync_final_model(bool is_last_joiner);
  /// One shadow step of a joined rank (DDP's main_hook), given the step's join allreduce.
  void shadow_step(const JoinStep& step);
  /// The join flags of this step (this rank's: has data, grad mode, synchronised backward):
  /// from Join::notify_join_context() when DDP is the first joinable (`notified`), otherwise
  /// from an allreduce of DDP's own.
  JoinFlags join_flags(bool has_data, bool grad_mode, bool sync,
                       const std::optional<JoinStep>& notified);

  std::shared_ptr<comm::ProcessGroup> group_;
  DistributedDataParallelOptions options_;
  std::unique_ptr<Reducer> reducer_;
  // What DDP synchronises: the parameters (each once) and buffers not ignored.
  std::vector<at::Tensor> synced_params_;
  std::vector<at::Tensor> synced_buffers_;
  bool divide_by_initial_world_size_ = true;  // set by join_hook(), as in PyTorch
  bool forward_prepared_ = false;
  // PyTorch's require_forward_param_sync: the previous forward prepared a synchronised backward.
  bool require_forward_param_sync_ = true;
};

/// DistributedDataParallel over a module of type ModuleType (deduced from a shared_ptr or a
/// module holder such as `Net` from TORCH_MODULE(Net)).
template <typename ModuleType = torch::nn::Module>
class DistributedDataParallel : public DistributedDataParallelBase {
 public:
  DistributedDataParallel(std::shared_ptr<ModuleType> module,
                          std::shared_ptr<comm::ProcessGroup> group,
                          DistributedDataParallelOptions options = {})
      : DistributedDataParallelBase(module, std::move(group), options), module_(std::move(module)) {}

  DistributedDataParallel(torch::nn::ModuleHolder<ModuleType> module,
                          std::shared_ptr<comm::ProcessGroup> group,
                          DistributedDataParallelOptions options = {})
      : DistributedDataParallel(module.ptr(), std::move(group), options) {}

  /// The wrapped module (whose state is what you checkpoint).
  const std::shared_ptr<ModuleType>& module() const { return module_; }

  /// prepare_for_forward(), the module's forward, prepare_for_backward(output).
  template <typename... Args>
  auto forward(Args&&... args) {
    prepare_for_forward();
    auto output = module_->forward(std::forward<Args>(args)...);
    using Output = std::decay_t<decltype(output)>;
    if constexpr (std::is_same_v<Output, at::Tensor> ||
                  std::is_same_v<Output, std::vector<at::Tensor>>) {
      prepare_for_backward(output);
    } else {
      prepare_for_backward_opaque();
    }
    return output;
  }

  template <typename... Args>
  auto operator()(Args&&... args) {
    return forward(std::forward<Args>(args)...);
  }

 private:
  std::shared_ptr<ModuleType> module_;
};

template <typename M>
DistributedDataParallel(std::shared_ptr<M>, std::shared_ptr<comm::ProcessGroup>)
    -> DistributedDataParallel<M>;
template <typename M>
DistributedDataParallel(std::shared_ptr<M>, std::shared_ptr<comm::ProcessGroup>,
                        DistributedDataParallelOptions) -> DistributedDataParallel<M>;
template <typename M>
DistributedDataParallel(torch::nn::ModuleHolder<M>, std::shared_ptr<comm::ProcessGroup>)
    -> DistributedDataParallel<M>;
template <typename M>
DistributedDataParallel(torch::nn::ModuleHolder<M>, std::shared_ptr<comm::ProcessGroup>,
                        DistributedDataParallelOptions) -> DistributedDataParallel<M>;

}  // namespace shoal::parallel

namespace shoal {
using parallel::DistributedDataParallel;
using parallel::DistributedDataParallelOptions;
}  // namespace shoal
