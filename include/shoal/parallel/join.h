// Join, Joinable and JoinHook: training with uneven inputs across ranks, the C++ counterpart of
// torch.distributed.algorithms.Join / Joinable / JoinHook.
//
//   Join join({ddp, optimizer}, JoinOptions{});   // the joinables, in the order they communicate
//   for (batch : this rank's batches) { ... ddp.forward(...) ... backward ... optimizer.step(); }
//   join.finish();                                 // or leave the scope
//
// Every joinable (DistributedDataParallel is one; a user object that communicates each step,
// such as an optimizer that allreduces, can be another) starts its per-step communication with
// Join::notify_join_context(*this): the first joinable of the scope then allreduces "this rank
// still has data" (plus the few flags it asks for), the others do nothing there. A rank whose
// data ran out calls finish(): while some rank still has data, it answers that allreduce with
// zeros and runs every joinable's JoinHook::main_hook(), which issues the collectives the
// joinable's step would have (with neutral values), so the ranks with data never wait for it.
// When no rank has data any more, every rank runs each post_hook(is_last_joiner).
//
// Differences from PyTorch, on purpose: main_hook receives the step's join allreduce (JoinStep:
// how many ranks still have data, and the first joinable's flags summed over them), so DDP learns
// the active ranks' grad mode and whether their backward is synchronised from the one allreduce
// it needs anyway; with throw_on_early_termination that same allreduce tells every rank at once
// (PyTorch spends a second one). Join's scope ends at finish() or at the destructor, after which
// the joinables are out of join mode again (PyTorch leaves them configured).
//
// Thread safety: like the joinables, driven by one thread per rank.
#pragma once

#include <c10/core/Device.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "shoal/comm/process_group.h"

namespace shoal::parallel {

/// PyTorch's Join arguments and DDP's join() arguments, with PyTorch's defaults. Every joinable's
/// join_hook() sees them all (PyTorch's **kwargs) and uses the ones it knows.
struct JoinOptions {
  /// False: the scope does nothing (the joinables communicate as outside any join).
  bool enable = true;
  /// Instead of shadowing, every rank throws shoal::Error as soon as one rank runs out of data
  /// (the step in which that is detected does not run).
  bool throw_on_early_termination = false;
  /// DDP: average over the full world size even when some ranks have finished (their zeros
  /// count); false: over the ranks that still have data at that step.
  bool divide_by_initial_world_size = true;
};

/// What the join allreduce of one step told every rank.
struct JoinStep {
  int active_ranks = 0;    ///< ranks that still have data at this step
  std::vector<int> flags;  ///< the first joinable's flags, summed over those ranks
};

/// PyTorch's _JoinConfig: what the current Join scope set on a joinable.
struct JoinConfig {
  bool enable = false;  ///< inside an enabled Join scope
  bool throw_on_early_termination = false;
  bool is_first_joinable = false;  ///< this joinable's notify_join_context() does the allreduce
};

/// What a joined rank does for one joinable (PyTorch's JoinHook).
class JoinHook {
 public:
  virtual ~JoinHook() = default;
  /// Called on a rank that ran out of data, once per step that some other rank still runs:
  /// issue the collectives the joinable's step issues, in the same order, with neutral values.
  virtual void main_hook(const JoinStep& step) {}
  /// Called on every rank once no rank has data any more (e.g. to make replicas equal);
  /// is_last_joiner: this rank was among the last to run out of data.
  virtual void post_hook(bool is_last_joiner) {}
};

/// An object that takes part in a Join (PyTorch's Joinable).
class Joinable {
 public:
  virtual ~Joinable() = default;
  /// The hook a joined rank runs for this object; `options` are the scope's arguments.
  virtual std::unique_ptr<JoinHook> join_hook(const JoinOptions& options) = 0;
  /// Where the join allreduce's tensor lives (the CPU unless the group needs a GPU tensor).
  virtual c10::Device join_device() const { return c10::Device(c10::kCPU); }
  /// The group the joinable communicates over; every joinable of a scope must share it.
  virtual std::shared_ptr<comm::ProcessGroup> join_process_group() const = 0;
  /// How many ints this joinable passes to notify_join_context() (carried by the join allreduce
  /// when it is the first joinable; main_hook then sees their sums in JoinStep::flags).
  virtual size_t join_flag_count() const { return 0; }

  const JoinConfig& join_config() const { return join_config_; }

 private:
  friend class Join;
  JoinConfig join_config_;
};

/// A join scope over some joinables (PyTorch's `with Join([...]):`); see the file comment.
class Join {
 public:
  /// The joinables in the order their per-step collectives run (the first one notifies).
  Join(std::vector<std::reference_wrapper<Joinable>> joinables, JoinOptions options = {});
  /// A scope over one joinable (what DistributedDataParallel::join() returns).
  explicit Join(Joinable* joinable, JoinOptions options = {});
  Join(Join&& other) noexcept;
  Join(const Join&) = delete;
  Join& operator=(const Join&) = delete;
  Join& operator=(Join&&) = delete;
  /// Calls finish() unless it ran or an exception is unwinding the stack.
  ~Join() noexcept(false);

  /// This rank is out of data: shadows the other ranks' steps (every main_hook, once per step)
  /// until all of them have finished, then runs every post_hook. Returns the steps shadowed.
  int64_t finish();

  /// Called by a joinable before its per-step collectives. For the first joinable of an enabled
  /// scope, allreduces "this rank has data" and `flags` (join_flag_count() of them) and returns
  /// the sums; throws on every rank when one ran out of data and throw_on_early_termination is
  /// set. For any other joinable, or outside a scope: nothing, and no value.
  static std::optional<JoinStep> notify_join_context(Joinable& joinable,
                                                     const std::vector<int>& flags = {});

 private:
  void end_scope();

  std::vector<Joinable*> joinables_;
  std::vector<std::unique_ptr<JoinHook>> hooks_;
  JoinOptions options_;
  std::shared_ptr<comm::ProcessGroup> group_;
  c10::Device device_{c10::kCPU};
  bool finished_ = false;
};

namespace detail {
/// The join allreduce of one step: [has data, flags...] summed over the ranks of `group`, on
/// `device` (noted "join" in hang reports). Join uses it, and DDP when it is not the first
/// joinable.
JoinStep allreduce_join_step(comm::ProcessGroup& group, const c10::Device& device, bool has_data,
                             const std::vector<int>& flags);
}  // namespace detail

}  // namespace shoal::parallel

namespace shoal {
using parallel::Join;
using parallel::Joinable;
using parallel::JoinHook;
using parallel::JoinOptions;
}  // namespace shoal
