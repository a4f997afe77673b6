// FullyShardedDataParallel: sharded data parallelism (ZeRO stages 1-3), the C++ counterpart of
// torch.distributed.fsdp.FullyShardedDataParallel and, at stage 1, of ZeroRedundancyOptimizer.
//
//   shoal::parallel::FullyShardedDataParallelOptions options;
//   options.sharding_strategy = shoal::parallel::ShardingStrategy::kFullShard;  // ZeRO-3
//   options.auto_wrap_min_num_params = 100'000;         // or options.units = {"fc1", "fc2"}
//   shoal::parallel::FullyShardedDataParallel fsdp(net, pg, options);
//   torch::optim::Adam optimizer(fsdp.parameters(), 1e-3);  // this rank's shards only
//   optimizer.zero_grad();
//   auto loss = torch::nll_loss(fsdp.forward(x), y);     // or prepare_for_forward/_backward
//   loss.backward();                                      // shard gradients averaged over ranks
//   optimizer.step();                                     // steps this rank's shard
//
// The module's parameters are grouped into units: the submodules named in options.units, those
// the size-based auto-wrap policy picks, and the root unit (every parameter no other unit holds).
// Each unit's parameters live in one flat buffer padded to a multiple of the world size; the
// module's parameters are views into it. Rank r owns the r-th equal piece of every buffer: its
// shard, a leaf tensor that fsdp.parameters() returns and the optimizer steps (so the optimizer
// state of SGD's momentum or Adam's moments is a shard's, 1/N of the model's). Under stages 1-2,
// whose flat buffers stay, a shard is the rank's own piece of its unit's buffer (no copy of its
// own: the optimizer steps it where the module reads it, and the all-gather writes only the
// peers' pieces, in place as PyTorch's FSDP gathers); under stage 3 a shard is a tensor of its
// own. On the CPU both are the process group's symmetric memory (ProcessGroup::empty_symmetric),
// from which the shm backend all-gathers each peer's piece directly.
//
// Sharding strategies (ZeRO's stages):
//   kShardOptimState (1)  the optimizer state is the shard's; full parameters and a full flat
//                         gradient buffer per unit stay on every rank (PyTorch's
//                         ZeroRedundancyOptimizer). The gradients are reduce-scattered from that
//                         buffer, as DeepSpeed's stage 1 does by default: a rank steps only its
//                         shard, so it receives only its shard's average (half an allreduce's
//                         bytes). On the CPU the buffer is the group's symmetric memory, which
//                         the shm backend reduce-scatters in place, without staging copies.
//   kShardGradOp     (2)  gradients are reduce-scattered too: a rank receives only its shard's
//                         sum (PyTorch's SHARD_GRAD_OP), and the full flat gradients are freed
//                         once reduced; full parameters stay.
//   kFullShard       (3)  also the parameters: a unit's flat buffer holds memory only while the
//                         unit runs (all-gathered before its forward and again before its
//                         backward, freed after each), the next unit's gather started before the
//                         current one computes (PyTorch's FULL_SHARD with forward/backward
//                         prefetch).
// Every training forward all-gathers the shards into the full parameters (the optimizer has
// changed them since the last one; LibTorch's optimizers do not bump a tensor's version, so FSDP
// cannot see whether they did), as does a forward without grad after a backward, and
// gather_full_parameters().
//
// Per-unit gathering needs to know when each unit runs. LibTorch modules have no forward hooks,
// so FSDP runs the units itself when the module is a torch::nn::Sequential (forward() calls its
// children in order, gathering the units inside each child just in time and prefetching the
// next); for any other module, prepare_for_forward() gathers every unit at once and backward
// frees each unit once its gradients are reduced: stage 3 then shards everything between steps
// but holds the whole model during forward.
//
// Gradient accumulation (PyTorch's `with fsdp.no_sync():`): a forward and backward run while a
// no_sync() guard is alive communicate nothing for the gradients: each module parameter keeps its
// local `.grad` (the full, unsharded gradient, as PyTorch FSDP keeps it, under every stage), and
// the next synchronised backward reduces the accumulated sum into the shards' gradients. Stage 3
// still gathers and frees the parameters around each unit as usual.
//
// clip_grad_norm_() is PyTorch's FSDP.clip_grad_norm_: the global L2 norm of the shards'
// gradients (each rank's sum of squares, all-reduced), every rank scaling by the same factor;
// total_grad_norm() is that norm alone. The module's own parameters hold no gradients after a
// synchronised backward (the shards do), so a norm over them is 0.
//
// Buffers (BatchNorm running statistics) are broadcast from rank 0 before each forward, as DDP
// does (when the previous forward was a training one). A parameter that gets no gradient in a
// backward pass contributes zeros to its unit's reduction (its shard's gradient is zero).
//
// Collectives, in this order, identical on every rank: at construction a parameter check and one
// broadcast per dtype (rank 0's parameters and buffers); before a forward, [buffer broadcast] and
// the units' all-gathers (stages 1-2: only when the shards changed since the last gather); during
// and at the end of backward, one reduce-scatter per unit,
// and under stage 3 the all-gathers of the units before their backward. Every rank must run the
// same forwards and backwards (no uneven inputs).
//
// The module's parameters stay views into the units' buffers when the wrapper is destroyed:
// under stage 3 call gather_full_parameters() first if the module is used on its own afterwards.
//
// Thread safety: one thread drives an instance (forward, backward, optimizer step). Several
// instances (one per rank) may run on different threads of one process.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "shoal/comm/process_group.h"
#include "shoal/parallel/no_sync.h"

namespace torch::optim {
class Optimizer;
}

namespace shoal::parallel {

/// What is sharded: ZeRO's stages (values 1, 2, 3), with PyTorch FSDP's names where it has one.
enum class ShardingStrategy {
  kShardOptimState = 1,  ///< ZeRO-1: optimizer state (PyTorch's ZeroRedundancyOptimizer)
  kShardGradOp = 2,      ///< ZeRO-2: + gradients (PyTorch's SHARD_GRAD_OP)
  kFullShard = 3,        ///< ZeRO-3: + parameters (PyTorch's FULL_SHARD)
};

/// The strategy of ZeRO stage 1, 2 or 3; InvalidArgument for any other number.
ShardingStrategy sharding_strategy_from_stage(int stage);

struct FullyShardedDataParallelOptions {
  ShardingStrategy sharding_strategy = ShardingStrategy::kFullShard;
  /// Submodules (by their names in the module, e.g. "layers.2") that are units of their own, as
  /// PyTorch users wrap submodules in FSDP. A parameter belongs to the innermost unit holding it.
  std::vector<std::string> units;
  /// PyTorch's size_based_auto_wrap_policy: when > 0, every submodule whose parameters not yet in
  /// a unit number at least this many becomes a unit (children first). 0: off.
  int64_t auto_wrap_min_num_params = 0;
  /// Copy rank 0's buffers to every rank before each forward (as DDP's broadcast_buffers).
  bool broadcast_buffers = true;
  /// Stage 3: start the next unit's all-gather before the current unit computes (forward and
  /// backward). Without it a unit is gathered when it is about to run.
  bool prefetch = true;
};

/// The bytes the wrapper holds for parameters and gradients (its flat buffers, its shards and
/// their gradients, and the module's own `.grad`s), for memory accounting. The optimizer's state
/// is the optimizer's (over parameters(), so a shard's).
struct FsdpMemoryStats {
  int64_t parameter_bytes = 0;       ///< full flat buffers holding memory now + stage 3's shards
  int64_t gradient_bytes = 0;        ///< shard gradients + module gradients + reduction buffers
  int64_t peak_parameter_bytes = 0;  ///< most parameter_bytes since reset_peak_memory_stats()
};

/// Sharded data parallelism over a module of any type (see the file comment).
class FullyShardedDataParallel {
 public:
  FullyShardedDataParallel(std::shared_ptr<torch::nn::Module> module,
                           std::shared_ptr<comm::ProcessGroup> group,
                           FullyShardedDataParallelOptions options = {});
  template <typename ModuleType>
  FullyShardedDataParallel(torch::nn::ModuleHolder<ModuleType> module,
                           std::shared_ptr<comm::ProcessGroup> group,
                           FullyShardedDataParallelOptions options = {})
      : FullyShardedDataParallel(module.ptr(), std::move(group), std::move(options)) {}
  ~FullyShardedDataParallel();
  FullyShardedDataParallel(const FullyShardedDataParallel&) = delete;
  FullyShardedDataParallel& operator=(const FullyShardedDataParallel&) = delete;

  /// The module's forward through FSDP. Needs a torch::nn::Sequential (whose children FSDP runs
  /// unit by unit); for other modules call prepare_for_forward(), the module, and
  /// prepare_for_backward(output).
  at::Tensor forward(const at::Tensor& input);
  at::Tensor operator()(const at::Tensor& input) { return forward(input); }

  /// Before the module's own forward: the buffer broadcast and the all-gathers that make every
  /// parameter of the module hold its current value.
  void prepare_for_forward();
  /// After it, with the forward's output: arms the gradient reduction of the coming backward (in
  /// grad mode); otherwise (no grad) stage 3 frees the parameters again.
  void prepare_for_backward(const at::Tensor& output);

  /// While alive, the backward of each forward run inside it reduces nothing (PyTorch's
  /// `with fsdp.no_sync():`); the first synchronised backward after it reduces the accumulated
  /// sum (shoal/parallel/no_sync.h, DDP's guard).
  using NoSyncGuard = parallel::NoSyncGuard;

  /// Forwards (and their backwards) inside the guard's lifetime accumulate gradients locally. The
  /// forward must run inside it, as with DDP: whether a backward reduces is fixed by its forward.
  NoSyncGuard no_sync();

  /// PyTorch's FSDP.clip_grad_norm_(max_norm) with norm_type 2, after backward: the total L2
  /// norm of the gradients of the whole model (each rank's shards' sum of squares, all-reduced:
  /// a collective), and every shard's gradient scaled by min(1, max_norm / (total + 1e-6)), so
  /// every rank clips alike. Returns the total norm before clipping.
  double clip_grad_norm_(double max_norm);

  /// The total L2 norm that clip_grad_norm_ clips, without clipping (for logging: NaN or inf when
  /// a gradient holds one). A collective (an allreduce of one double): every rank calls it after
  /// the same synchronised backward.
  double total_grad_norm();

  /// This rank's shards, one per unit, in unit order: what the optimizer steps. Leaves that
  /// require grad; backward sets their `.grad` to the shard of the averaged gradient.
  std::vector<at::Tensor> parameters() const;

  /// Makes every parameter of the module hold its current full value until the next training
  /// forward (stage 3 gathers them; stages 1-2 gather when the shards changed): before
  /// evaluating the module directly or saving its state_dict. A collective.
  void gather_full_parameters();

  /// PyTorch's FSDP.full_optim_state_dict, as an optimizer: a new optimizer of `sharded`'s kind
  /// and options (SGD, Adam or AdamW) over the module's parameters (module()->parameters() order),
  /// holding the whole state gathered from every rank's shard. What a checkpoint saves: it is the
  /// optimizer DDP would have, so checkpoints of both load in either, at any world size. A
  /// collective.
  std::unique_ptr<torch::optim::Optimizer> full_optimizer(torch::optim::Optimizer& sharded);
  /// The reverse (PyTorch's shard_full_optim_state_dict): sets `sharded`'s state (over
  /// parameters()) to this rank's shard of `full`'s (over the module's parameters, as a
  /// checkpoint restores it). No communication: every rank has `full`.
  void load_full_optimizer(torch::optim::Optimizer& full, torch::optim::Optimizer& sharded);

  /// The units: name ("" is the root unit), parameter names, where each parameter lies in the
  /// flat buffer, element count before padding. What a sharded checkpoint records.
  struct UnitInfo {
    std::string name;
    std::vector<std::string> parameter_names;
    int64_t numel = 0;         ///< the parameters' elements
    int64_t padded_numel = 0;  ///< numel rounded up to a multiple of the world size
    std::vector<int64_t> offsets;              ///< of each parameter in the flat buffer
    std::vector<std::vector<int64_t>> shapes;  ///< of each parameter
  };
  std::vector<UnitInfo> units() const;

  FsdpMemoryStats memory_stats() const;
  void reset_peak_memory_stats();

  ShardingStrategy sharding_strategy() const { return options_.sharding_strategy; }
  const std::shared_ptr<torch::nn::Module>& module() const { return module_; }
  const std::shared_ptr<comm::ProcessGroup>& process_group() const { return group_; }

 private:
  struct Unit;
  void build_units();
  /// Starts the unit's all-gather unless one is in flight or (without `force`) `full` is current;
  /// `async_op` false: returns once it is done (the caller needs it now: no hand-off).
  void gather(Unit& unit, bool force, bool async_op = true);
  void gather_all(bool force);
  bool must_gather() const;
  void wait_gathered(Unit& unit);
  void free_full(Unit& unit);
  void on_grad_ready(size_t unit_index);
  void reduce_unit(Unit& unit);
  /// Waits for the unit's reduction and adds its result to the shard's gradient.
  void complete_reduction(Unit& unit);
  void finish_backward();
  bool will_sync_buffers() const;
  void note_parameter_bytes();

  std::shared_ptr<torch::nn::Module> module_;
  std::shared_ptr<comm::ProcessGroup> group_;
  FullyShardedDataParallelOptions options_;
  std::vector<std::unique_ptr<Unit>> units_;
  std::vector<at::Tensor> buffers_;
  bool require_forward_param_sync_ = true;
  bool backward_armed_ = false;
  bool grad_sync_ = true;         ///< false inside no_sync()
  bool sync_this_backward_ = true;  ///< grad_sync_ at the forward of the coming backward
  bool callback_queued_ = false;
  bool stale_ = false;  ///< a backward has run since the last gather (a step may have followed)
  int64_t peak_parameter_bytes_ = 0;
};

/// An optimizer of `given`'s kind and options (SGD, Adam or AdamW, one parameter group) over
/// `params`, without state: the optimizer over the shards, from the one a user built over the
/// module.
std::unique_ptr<torch::optim::Optimizer> optimizer_like(const torch::optim::Optimizer& given,
                                                        std::vector<at::Tensor> params);

}  // namespace shoal::parallel

namespace shoal {
using parallel::FullyShardedDataParallel;
using parallel::FullyShardedDataParallelOptions;
}  // namespace shoal
