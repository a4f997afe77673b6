// Reducer: the gradient bucketing, overlap and averaging engine behind DistributedDataParallel.
//
// Owns the buckets (flat gradient tensors), the hooks on every parameter's gradient accumulator and
// the end-of-backward callback. See distributed_data_parallel.h for the algorithm and the order of
// collectives.
//
// Thread safety: driven by one thread (the one running forward/backward on this rank).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "compat/autograd_hooks.h"
#include "compat/ddp_semantics.h"
#include "parallel/bucket_cap_tuner.h"
#include "parallel/slot_lender.h"
#include "shoal/comm/process_group.h"
#include "shoal/parallel/distributed_data_parallel.h"

namespace shoal::parallel {

class Reducer {
 public:
  /// `parameters` in registration order (only those requiring grad), with their names;
  /// `sparse[i]` when parameter i gets sparse gradients (Embedding with sparse = true): it has no
  /// bucket and is reduced at the end of backward by an allgather of indices and values.
  Reducer(std::vector<at::Tensor> parameters, std::vector<std::string> names,
          std::vector<bool> sparse, std::shared_ptr<comm::ProcessGroup> group,
          const DistributedDataParallelOptions& options);
  ~Reducer();
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  void set_comm_hook(CommHook hook);
  /// False inside no_sync(): hooks let gradients accumulate in .grad.
  void set_grad_sync(bool enabled) { grad_sync_ = enabled; }
  bool grad_sync() const { return grad_sync_; }
  /// Multiplies the next synchronised backward's averaged gradients (join with
  /// divide_by_initial_world_size = false: world size / ranks with data).
  void set_gradient_scale(double scale) { gradient_scale_ = scale; }

  /// Called after a forward whose backward is to be synchronised: resets the iteration state
  /// (also after a backward that ended in an exception) and, with find_unused_parameters, finds
  /// the parameters `outputs` do not depend on.
  void prepare_for_backward(const std::vector<at::Tensor>& outputs);
  /// Called at every grad-mode forward, on every rank at the same steps (a joined rank too).
  /// Once (the first grad-mode forward after the first completed synchronised backward): rebuilds
  /// buckets from rank 0's gradient arrival order (one broadcast). With bucket_cap_mb = auto, the
  /// calls after it move through the candidate caps and finally pick one (one allreduce).
  void rebuild_buckets();
  bool buckets_rebuilt() const { return rebuilt_; }
  /// A joined rank's side of one step: reduces zero buckets with the others (its own gradients
  /// are left alone).
  void shadow_backward();

  ReducerStats stats() const;

  /// Throws when a parameter's dtype or device changed since DDP was built (module->to(...) after
  /// wrapping: LibTorch then drops the gradient hooks, and the buckets have the old type).
  void check_parameters_unchanged() const;

 private:
  struct Bucket {
    at::Tensor contents;                 // flat gradients
    std::vector<size_t> variables;       // parameter indices, in slice order
    std::vector<at::Tensor> views;       // slices of contents shaped like the parameters
    size_t pending = 0;                  // gradients still missing this iteration
    std::shared_ptr<comm::Work> work;    // the reduction in flight
    bool copied_out = false;             // its .grads already hold this iteration's result
    // What the communication hook sees, built with the bucket: launching a reduction from the
    // backward hook then allocates nothing.
    std::unique_ptr<GradBucket> hook_view;
  };

  /// Which parameters share a bucket, for parameters in `order` (expected gradient order) and
  /// buckets of `cap_mb` after the first; in the order the buckets will be reduced.
  std::vector<std::vector<size_t>> assign_buckets(const std::vector<size_t>& order,
                                                  double first_cap_mb, double cap_mb) const;
  void build_buckets(const std::vector<size_t>& order, double first_cap_mb, double cap_mb);
  /// bucket_cap_mb = auto: the step of the tuning schedule (BucketCapTuner); builds the buckets it
  /// asks for.
  void tune_bucket_cap();
  void autograd_hook(size_t index);
  void begin_backward();
  void mark_ready(size_t index);
  /// Waits (ignoring errors) for reductions a failed backward left in flight; clears its state.
  void abandon_backward();
  void launch_ready_buckets();
  std::shared_ptr<comm::Work> launch(size_t bucket_index);
  /// Where gradients live relative to their buckets (gradient_placement.h): one of three
  /// layouts, and whether the SlotLender computes them in their slots. Chosen at construction and
  /// again when its inputs change (a comm hook registered, static_graph's first iteration learnt).
  class Placement;
  class ViewPlacement;
  class CopyPlacement;
  class SlotPlacement;
  void choose_placement();
  /// A new tensor of its own over parameter `index`'s slot of bucket `bucket`, shaped like the
  /// slot's view; the bucket's memory lives as long as it does.
  at::Tensor slot_gradient(const Bucket& bucket, size_t slot, size_t index);
  /// Before this step writes parameter `index`'s slot: a gradient handed out there earlier that
  /// is no longer the parameter's .grad but still alive (a reference the caller kept across
  /// zero_grad(set_to_none)) moves to memory of its own, its values intact.
  void release_slot(size_t index, const at::Tensor& grad);
  /// Gives `handed` (a slot gradient's storage) memory of its own with the same bytes: every
  /// tensor on it keeps its values, and the slot is no longer theirs.
  void move_out_of_slot(size_t index, c10::StorageImpl& handed);
  /// The end-of-backward callback: finalize_backward(), unless a re-entrant backward ended with
  /// gradients still missing (the outer backward goes on; the next hook queues it again).
  void on_backward_end();
  void finalize_backward();
  /// Some gradients never arrived: waits for what was launched, then throws naming them.
  [[noreturn]] void throw_missing_gradients();
  /// find_unused_parameters: starts the allreduce of the parameters used on this rank into
  /// `used_map` (null when not tracking).
  std::shared_ptr<comm::Work> start_used_exchange(at::Tensor& used_map);
  /// Multiplies this step's results by a join's gradient scale (once) and returns it.
  double apply_gradient_scale();
  /// Which parameters some rank used (null: all), from this step's `used_map` or static_graph.
  const int* used_everywhere(const at::Tensor& used_map) const;
  /// A synchronised step (this rank's or a joined rank's shadow) is over.
  void end_synced_step();
  /// debug_detail: every rank learns every rank's used set; throws on every rank when they differ.
  void check_used_on_every_rank();
  /// Whether this iteration finds and exchanges unused parameters (find_unused_parameters, or the
  /// first iteration of static_graph).
  bool tracks_unused() const;
  /// static_graph: after the first iteration, keeps which parameters no rank used.
  void learn_static_graph(const at::Tensor& used_map);
  /// Averages parameter `index`'s sparse gradient across ranks (allgather, sum, coalesce), times
  /// `scale`; a `shadow` (joined) rank takes part with nothing and keeps its .grad.
  void reduce_sparse(size_t index, bool used_somewhere, double scale, bool shadow);
  void wait_bucket(size_t bucket_index);
  /// With lending_: asks the lender where `grad` (parameter `index`'s, just arrived) was computed;
  /// returns whether in its own slot, laid out like `view`. Marks deferred_ when another tensor
  /// holds the slot.
  bool take_from_lender(size_t index, const at::Tensor& grad, const at::Tensor& view);
  /// Before bucket `bucket_index` is reduced: the gradients whose slots were held by another
  /// tensor when they arrived (deferred_) go through their slots for the reduction, the other
  /// tensor's bytes put back after it (see launch_ready_buckets).
  std::vector<std::pair<size_t, at::Tensor>> place_deferred(size_t bucket_index);
  void restore_deferred(size_t bucket_index, std::vector<std::pair<size_t, at::Tensor>>& saved);
  std::string describe_bucket(size_t bucket_index) const;

  std::vector<at::Tensor> params_;
  std::vector<std::string> names_;
  std::vector<bool> sparse_;
  std::vector<at::TensorOptions> param_options_;  // dtype and device at construction
  std::shared_ptr<comm::ProcessGroup> group_;
  DistributedDataParallelOptions options_;
  // options_.bucket_reduction, kAuto decided at construction; false once a hook is registered
  bool inline_reduction_;
  CommHook hook_;
  std::vector<std::unique_ptr<compat::GradAccumulatedHook>> hooks_;

  std::vector<Bucket> buckets_;
  std::vector<std::pair<size_t, size_t>> locator_;  // parameter -> (bucket, slot)
  // SlotPlacement: per parameter, the storage of the slot gradient last handed out.
  std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> handed_;
  // Gradients computed in their slots (null where the allocator could not be put in place).
  std::shared_ptr<SlotLender> lender_;
  std::unique_ptr<Placement> placement_;
  // The lender places gradients this step: bucket views or slot gradients, reduced inline, no
  // unused parameters to find, no debug_detail (choose_placement).
  bool lending_ = false;
  // Per parameter, this backward: its gradient arrived while its slot held another live tensor
  // (deferred_), and then its .grad got the result directly (result_in_grad_).
  std::vector<char> deferred_;
  std::vector<char> result_in_grad_;
  // Per parameter, at each forward: whether its slot may take this step's new gradient (sized
  // once, refilled every step: nothing allocated per step).
  std::vector<char> slot_free_;

  bool grad_sync_ = true;
  double gradient_scale_ = 1.0;
  bool in_backward_ = false;
  bool callback_queued_ = false;
  // PyTorch's expect_autograd_hooks_: prepare_for_backward() armed the next backward; a second
  // backward on the same graph (retain_graph) then only accumulates locally, as in PyTorch. A
  // caller that never calls prepare_for_backward() (module called directly, without
  // find_unused_parameters) gets every backward outside no_sync() synchronised.
  bool expect_hooks_ = false;
  bool ever_prepared_ = false;
  size_t next_bucket_ = 0;               // first bucket not launched yet
  std::vector<char> ready_;              // per parameter, this iteration
  // Per parameter: got a defined gradient in this synchronised backward (as in PyTorch, use in
  // earlier no_sync() micro-batches does not count; their accumulated .grad is still reduced when
  // another rank uses the parameter).
  std::vector<char> locally_used_;
  // As the PyTorch built against (compat/ddp_semantics.h): no_sync() passes mark use too.
  const bool no_sync_use_counts_ = compat::ddp_no_sync_use_counts();
  std::vector<size_t> unused_;           // from prepare_for_backward (find_unused_parameters)
  bool unused_known_ = false;
  bool static_known_ = false;            // static_graph: the first iteration is over
  std::vector<size_t> static_unused_;    // static_graph: unused on every rank, marked each step
  std::vector<int> static_used_;         // static_graph: used somewhere (per parameter)

  bool rebuilt_ = false;
  bool synced_once_ = false;             // a synchronised backward completed (rebuild may run)
  std::vector<size_t> arrival_order_;    // first synchronised backward's gradient order
  std::vector<char> arrived_;

  std::vector<size_t> bucket_order_;     // the order buckets are built in (rebuilt: rank 0's)
  double first_cap_mb_ = 0;              // first_bucket_cap_mb of the current buckets
  double cap_mb_ = 0;                    // bucket_cap_mb of the current buckets
  // Synchronised backward passes, a joined rank's shadow ones included (the same on every rank).
  int64_t synced_steps_ = 0;
  BucketCapTuner tuner_{options_};  // bucket_cap_mb = auto
  bool auto_cap() const {
    return options_.bucket_cap_mb == DistributedDataParallelOptions::kBucketCapAuto;
  }

  std::chrono::steady_clock::time_point backward_start_;
  ReducerStats stats_;
};

}  // namespace shoal::parallel
