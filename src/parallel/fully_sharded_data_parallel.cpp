#include "shoal/parallel/fully_sharded_data_parallel.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <unordered_set>
#include <utility>

#include "compat/autograd_hooks.h"
#include "compat/optimizer_state.h"
#include "compat/storage.h"
#include "parallel/module_sync.h"
#include "shoal/error.h"
#include "shoal/memory/cpu_allocator.h"

namespace shoal::parallel {

ShardingStrategy sharding_strategy_from_stage(int stage) {
  switch (stage) {
    case 1:
      return ShardingStrategy::kShardOptimState;
    case 2:
      return ShardingStrategy::kShardGradOp;
    case 3:
      return ShardingStrategy::kFullShard;
    default:
      SHOAL_THROW(InvalidArgument, "sharding stage ", stage,
                  " does not exist: use 1 (optimizer state), 2 (+ gradients) or 3 (+ parameters)");
  }
}

struct FullyShardedDataParallel::Unit {
  std::string name;  ///< the submodule's name; "" for the root unit
  std::vector<std::string> param_names;
  std::vector<at::Tensor> params;  ///< the module's parameters: views into `full`
  std::vector<int64_t> offsets;    ///< of each parameter in `full`
  int64_t numel = 0;
  int64_t padded = 0;
  int64_t shard_numel = 0;
  at::Tensor full;   ///< [padded]; its storage is freed between uses under stage 3
  /// [shard_numel] leaf: this rank's piece, what the optimizer steps; stages 1-2: `full`'s own
  /// piece (the same storage), stage 3: a tensor of its own
  at::Tensor shard;
  at::Tensor reduce_input;   ///< [padded] the flat local gradients, while being reduced
  /// Stage 1 only: where reduce_input lives, kept between steps (ZeRO-1 keeps full gradients;
  /// on the CPU in symmetric memory, so the shm backend reduce-scatters from the ranks' copies
  /// in place instead of staging them).
  at::Tensor grad_buffer;
  at::Tensor reduce_output;  ///< [shard_numel] the reduce-scatter's result
  std::shared_ptr<comm::Work> gather_work;
  std::shared_ptr<comm::Work> reduce_work;
  std::vector<std::unique_ptr<compat::GradAccumulatedHook>> hooks;
  size_t ready = 0;      ///< parameters whose gradient this backward has accumulated
  bool reduced = false;  ///< this backward's reduction has been started
  /// `full` holds memory and the shard values of its last gather (or of construction).
  bool current = false;

  int64_t element_size() const { return static_cast<int64_t>(full.element_size()); }
};

namespace {

bool has_prefix(const std::string& name, const std::string& unit) {
  if (unit.empty()) return true;
  return name.size() > unit.size() && name.compare(0, unit.size(), unit) == 0 &&
         name[unit.size()] == '.';
}

// PyTorch's size_based_auto_wrap_policy, children first: a submodule whose parameters not yet in
// a unit number at least `min_params` becomes a unit. Returns the parameters of `module` left
// outside units.
int64_t auto_wrap(const torch::nn::Module& module, const std::string& prefix, int64_t min_params,
                  bool is_root, std::vector<std::string>& chosen) {
  int64_t left = 0;
  for (const auto& child : module.named_children()) {
    const std::string name = prefix.empty() ? child.key() : prefix + "." + child.key();
    left += auto_wrap(*child.value(), name, min_params, false, chosen);
  }
  for (const auto& param : module.named_parameters(/*recurse=*/false)) {
    left += param.value().numel();
  }
  if (!is_root && left >= min_params) {
    chosen.push_back(prefix);
    return 0;
  }
  return left;
}

}  // namespace

FullyShardedDataParallel::FullyShardedDataParallel(std::shared_ptr<torch::nn::Module> module,
                                                   std::shared_ptr<comm::ProcessGroup> group,
                                                   FullyShardedDataParallelOptions options)
    : module_(std::move(module)), group_(std::move(group)), options_(std::move(options)) {
  SHOAL_CHECK_T(InvalidArgument, module_ != nullptr, "FullyShardedDataParallel: the module is null");
  SHOAL_CHECK_T(InvalidArgument, group_ != nullptr,
                "FullyShardedDataParallel: the process group is null");
  const int stage = static_cast<int>(options_.sharding_strategy);
  SHOAL_CHECK_T(InvalidArgument, stage >= 1 && stage <= 3, "FullyShardedDataParallel: sharding "
                "strategy ", stage, " does not exist: use stage 1, 2 or 3");
  SHOAL_CHECK_T(InvalidArgument, options_.auto_wrap_min_num_params >= 0,
                "FullyShardedDataParallel: auto_wrap_min_num_params must not be negative, got ",
                options_.auto_wrap_min_num_params);
  memory::tune_cpu_allocator();  // as DDP: freed buffers are reused at once, not faulted in again
  build_units();
}

FullyShardedDataParallel::~FullyShardedDataParallel() = default;

void FullyShardedDataParallel::build_units() {
  torch::NoGradGuard no_grad;
  const auto named = unique_named_parameters(*module_);
  verify_same_parameters(*group_, named, "FullyShardedDataParallel");
  for (const auto& item : module_->named_buffers(true)) buffers_.push_back(item.value());
  {
    std::vector<at::Tensor> state = named.values();
    state.insert(state.end(), buffers_.begin(), buffers_.end());
    broadcast_coalesced(*group_, state);
  }

  // The units' submodules: the user's, then the policy's.
  std::vector<std::string> roots;
  {
    std::unordered_set<std::string> modules;
    for (const auto& item : module_->named_modules("", /*include_self=*/false)) {
      modules.insert(item.key());
    }
    for (const auto& name : options_.units) {
      SHOAL_CHECK_T(InvalidArgument, modules.count(name) > 0, "FullyShardedDataParallel: unit '",
                    name, "' is no submodule of the module; name submodules as named_modules() "
                    "does (\"layers.2\")");
      roots.push_back(name);
    }
    if (options_.auto_wrap_min_num_params > 0) {
      std::vector<std::string> chosen;
      auto_wrap(*module_, "", options_.auto_wrap_min_num_params, true, chosen);
      for (const auto& name : chosen) {
        if (std::find(roots.begin(), roots.end(), name) == roots.end()) roots.push_back(name);
      }
    }
  }

  // Each parameter goes to the innermost unit holding it; units are ordered by their first
  // parameter (registration order, which for a Sequential is execution order).
  std::vector<Unit*> by_root(roots.size() + 1, nullptr);
  for (const auto& item : named) {
    const at::Tensor& param = item.value();
    if (!param.requires_grad()) continue;  // frozen: stays replicated, as a buffer
    size_t best = roots.size();            // the root unit
    for (size_t i = 0; i < roots.size(); ++i) {
      if (has_prefix(item.key(), roots[i]) &&
          (best == roots.size() || roots[i].size() > roots[best].size())) {
        best = i;
      }
    }
    if (by_root[best] == nullptr) {
      units_.push_back(std::make_unique<Unit>());
      by_root[best] = units_.back().get();
      by_root[best]->name = best == roots.size() ? "" : roots[best];
    }
    Unit& unit = *by_root[best];
    if (!unit.params.empty()) {
      const at::Tensor& first = unit.params.front();
      SHOAL_CHECK_T(InvalidArgument,
                    first.scalar_type() == param.scalar_type() && first.device() == param.device(),
                    "FullyShardedDataParallel: unit '", unit.name, "' mixes ",
                    c10::toString(first.scalar_type()), " on ", first.device(), " ('",
                    unit.param_names.front(), "') with ", c10::toString(param.scalar_type()),
                    " on ", param.device(), " ('", item.key(),
                    "'); a unit's parameters share one flat buffer: make them separate units");
    }
    unit.param_names.push_back(item.key());
    unit.params.push_back(param);
    unit.offsets.push_back(unit.numel);
    unit.numel += param.numel();
  }

  const int64_t world = group_->size();
  const int64_t rank = group_->rank();
  for (size_t u = 0; u < units_.size(); ++u) {
    Unit& unit = *units_[u];
    unit.padded = (unit.numel + world - 1) / world * world;
    unit.shard_numel = unit.padded / world;
    const at::Tensor& first = unit.params.front();
    const bool keeps_full = options_.sharding_strategy != ShardingStrategy::kFullShard;
    // Stages 1-2 keep the flat buffer and shard it in place: on the CPU in symmetric memory (a
    // collective: the same units in the same order on every rank), whose all-gather the shm
    // backend runs in place, copying only the peers' pieces straight from their memory.
    unit.full = keeps_full && first.device().is_cpu()
                    ? group_->empty_symmetric(unit.padded, first.scalar_type())
                    : at::empty({unit.padded}, first.options().requires_grad(false));
    unit.full.narrow(0, unit.numel, unit.padded - unit.numel).zero_();
    for (size_t i = 0; i < unit.params.size(); ++i) {
      at::Tensor& param = unit.params[i];
      at::Tensor view = unit.full.narrow(0, unit.offsets[i], param.numel()).view(param.sizes());
      view.copy_(param);
      param.set_data(view);
    }
    const at::Tensor piece = unit.full.narrow(0, rank * unit.shard_numel, unit.shard_numel);
    if (keeps_full) {
      // The piece itself, as a leaf of its own (not an autograd view of `full`): the optimizer
      // steps it in place where the module's parameters read it.
      unit.shard = at::empty({0}, piece.options());
      unit.shard.set_(piece.storage(), piece.storage_offset(), {unit.shard_numel}, {1});
    } else if (piece.device().is_cpu()) {
      // In symmetric memory (a collective: the same units in the same order on every rank), the
      // shm backend's all-gathers copy each peer's shard straight from the peer's memory instead
      // of staging it through the group's buffers: a copy and most rendezvous fewer per gather.
      // Other backends hand out ordinary memory.
      unit.shard = group_->empty_symmetric(unit.shard_numel, piece.scalar_type()).copy_(piece);
    } else {
      unit.shard = piece.clone();
    }
    unit.shard.set_requires_grad(true);
    if (options_.sharding_strategy == ShardingStrategy::kShardOptimState) {
      // A collective too (same units, same order on every rank), like the shard's.
      unit.grad_buffer = piece.device().is_cpu()
                             ? group_->empty_symmetric(unit.padded, piece.scalar_type())
                             : at::empty({unit.padded}, piece.options());
      unit.grad_buffer.narrow(0, unit.numel, unit.padded - unit.numel).zero_();
    }
    for (const auto& param : unit.params) {
      unit.hooks.push_back(compat::add_grad_accumulated_hook(param, [this, u] { on_grad_ready(u); }));
    }
    unit.current = true;
    if (options_.sharding_strategy == ShardingStrategy::kFullShard) free_full(unit);
  }
  note_parameter_bytes();
}

std::vector<at::Tensor> FullyShardedDataParallel::parameters() const {
  std::vector<at::Tensor> shards;
  for (const auto& unit : units_) shards.push_back(unit->shard);
  return shards;
}

std::vector<FullyShardedDataParallel::UnitInfo> FullyShardedDataParallel::units() const {
  std::vector<UnitInfo> infos;
  for (const auto& unit : units_) {
    UnitInfo info{unit->name, unit->param_names, unit->numel, unit->padded, unit->offsets, {}};
    for (const auto& param : unit->params) info.shapes.push_back(param.sizes().vec());
    infos.push_back(std::move(info));
  }
  return infos;
}

// ---- gathering and freeing the full parameters --------------------------------------------------

void FullyShardedDataParallel::gather(Unit& unit, bool force, bool async_op) {
  if (unit.gather_work) return;  // in flight
  // Whether to gather is decided the same way on every rank (the same calls, in the same order):
  // LibTorch's optimizers change a shard without bumping its version, so a change cannot be seen.
  if (unit.current && !force) return;
  compat::allocate_storage(unit.full, static_cast<size_t>(unit.padded * unit.element_size()));
  note_parameter_bytes();
  comm::AllgatherOptions options;
  options.async_op = async_op;
  unit.gather_work = group_->all_gather_into_tensor(unit.full, unit.shard.detach(), options);
  unit.current = true;
}

void FullyShardedDataParallel::wait_gathered(Unit& unit) {
  gather(unit, false, /*async_op=*/false);
  if (unit.gather_work) {
    auto work = std::move(unit.gather_work);
    unit.gather_work = nullptr;
    work->wait();
  }
}

void FullyShardedDataParallel::free_full(Unit& unit) {
  if (options_.sharding_strategy != ShardingStrategy::kFullShard) return;
  if (unit.gather_work) wait_gathered(unit);
  compat::free_storage(unit.full);
  unit.current = false;
}

void FullyShardedDataParallel::note_parameter_bytes() {
  peak_parameter_bytes_ = std::max(peak_parameter_bytes_, memory_stats().parameter_bytes);
}

void FullyShardedDataParallel::gather_full_parameters() { gather_all(/*force=*/true); }

void FullyShardedDataParallel::gather_all(bool force) {
  for (auto& unit : units_) gather(*unit, force);
  for (auto& unit : units_) wait_gathered(*unit);
  stale_ = false;
}

bool FullyShardedDataParallel::must_gather() const {
  // A training forward follows an optimizer step (which changed the shards) in a correct loop; a
  // forward without grad after a backward may too.
  return torch::GradMode::is_enabled() || stale_;
}

// ---- forward -------------------------------------------------------------------------------------

bool FullyShardedDataParallel::will_sync_buffers() const {
  return require_forward_param_sync_ && options_.broadcast_buffers && group_->size() > 1 &&
         !buffers_.empty();
}

void FullyShardedDataParallel::prepare_for_forward() {
  if (will_sync_buffers()) broadcast_coalesced(*group_, buffers_);
  gather_all(must_gather());
}

void FullyShardedDataParallel::prepare_for_backward(const at::Tensor& output) {
  if (torch::GradMode::is_enabled() && output.defined() && output.requires_grad()) {
    // As DDP: a forward inside no_sync() leaves the next forward's buffer broadcast out.
    require_forward_param_sync_ = grad_sync_;
    backward_armed_ = true;
    sync_this_backward_ = grad_sync_;
    callback_queued_ = false;
    for (auto& unit : units_) {
      unit->ready = 0;
      unit->reduced = false;
    }
  } else {
    require_forward_param_sync_ = false;
    for (auto& unit : units_) free_full(*unit);
  }
}

at::Tensor FullyShardedDataParallel::forward(const at::Tensor& input) {
  auto* sequential = module_->as<torch::nn::SequentialImpl>();
  SHOAL_CHECK_T(InvalidArgument, sequential != nullptr,
                "FullyShardedDataParallel::forward runs a torch::nn::Sequential unit by unit; for "
                "another module call fsdp.prepare_for_forward(), the module's forward, then "
                "fsdp.prepare_for_backward(output)");
  if (options_.sharding_strategy != ShardingStrategy::kFullShard) {
    prepare_for_forward();
    at::Tensor output = sequential->forward(input);
    prepare_for_backward(output);
    return output;
  }
  if (will_sync_buffers()) broadcast_coalesced(*group_, buffers_);

  // Which units each child holds; units outside every child (the root's own) stay gathered.
  const auto children = sequential->named_children();
  std::vector<std::vector<size_t>> held(children.size());
  std::vector<size_t> always;
  for (size_t u = 0; u < units_.size(); ++u) {
    bool placed = false;
    for (size_t c = 0; c < children.size() && !placed; ++c) {
      const std::string& child = children[c].key();
      if (units_[u]->name == child || has_prefix(units_[u]->name, child)) {
        held[c].push_back(u);
        placed = true;
      }
    }
    if (!placed) always.push_back(u);
  }
  auto next_with_units = [&](size_t from) {
    for (size_t c = from; c < held.size(); ++c) {
      if (!held[c].empty()) return c;
    }
    return held.size();
  };
  const bool force = must_gather();
  stale_ = false;
  for (size_t u : always) gather(*units_[u], force);
  for (size_t u : always) wait_gathered(*units_[u]);
  if (size_t first = next_with_units(0); first < held.size()) {
    for (size_t u : held[first]) gather(*units_[u], force);
  }

  const bool grad = torch::GradMode::is_enabled();
  at::Tensor x = input;
  size_t c = 0;
  for (auto it = sequential->begin(); it != sequential->end(); ++it, ++c) {
    for (size_t u : held[c]) {
      gather(*units_[u], force, /*async_op=*/false);  // unless prefetched: needed now
      wait_gathered(*units_[u]);
    }
    if (options_.prefetch) {
      if (size_t next = next_with_units(c + 1); next < held.size()) {
        for (size_t u : held[next]) gather(*units_[u], force);
      }
    }
    x = it->forward(x);
    if (held[c].empty()) continue;
    if (grad && x.requires_grad()) {
      // Before this child's backward: its units again, and the previous child's prefetched.
      std::vector<size_t> mine = held[c];
      std::vector<size_t> previous;
      for (size_t p = c; p-- > 0;) {
        if (!held[p].empty()) {
          previous = held[p];
          break;
        }
      }
      x.register_hook([this, mine, previous](const at::Tensor&) {
        if (!backward_armed_) return;
        if (!callback_queued_) {
          callback_queued_ = true;
          compat::queue_backward_callback([this] { finish_backward(); });
        }
        for (size_t u : mine) gather(*units_[u], false);
        if (options_.prefetch) {
          for (size_t u : previous) gather(*units_[u], false);
        }
        for (size_t u : mine) wait_gathered(*units_[u]);
      });
    }
    for (size_t u : held[c]) free_full(*units_[u]);
  }
  prepare_for_backward(x);
  return x;
}

// ---- backward ------------------------------------------------------------------------------------

void FullyShardedDataParallel::on_grad_ready(size_t unit_index) {
  if (!backward_armed_) return;
  if (!callback_queued_) {
    callback_queued_ = true;
    compat::queue_backward_callback([this] { finish_backward(); });
  }
  Unit& unit = *units_[unit_index];
  if (++unit.ready < unit.params.size()) return;
  if (sync_this_backward_) {
    reduce_unit(unit);
  } else {
    free_full(unit);  // no_sync: the `.grad`s stay on the module's parameters, summing up
  }
}

void FullyShardedDataParallel::reduce_unit(Unit& unit) {
  torch::NoGradGuard no_grad;
  unit.reduced = true;
  if (unit.grad_buffer.defined()) {
    unit.reduce_input = unit.grad_buffer;  // its padding stays zero
  } else {
    unit.reduce_input = at::empty({unit.padded}, unit.full.options());
    unit.reduce_input.narrow(0, unit.numel, unit.padded - unit.numel).zero_();
  }
  for (size_t i = 0; i < unit.params.size(); ++i) {
    at::Tensor& param = unit.params[i];
    at::Tensor slice = unit.reduce_input.narrow(0, unit.offsets[i], param.numel());
    const at::Tensor& grad = param.grad();
    if (grad.defined()) {
      slice.view(param.sizes()).copy_(grad);
      param.mutable_grad() = at::Tensor();  // the shard's gradient replaces it
    } else {
      slice.zero_();  // unused in this backward: contributes nothing
    }
  }
  // Bounds the reductions in flight: each holds its flat gradients (and the backend's buffers:
  // Gloo's old allreduce path copied them all), so leaving them all to the end of backward held
  // one or two more model-sized buffers (what took FSDP past DDP's memory on a 2-rank job). The one started last keeps overlapping
  // the backward of the next unit. Waiting issues no collective: the order stays the same.
  for (auto& other : units_) {
    if (other.get() != &unit && other->reduce_work) complete_reduction(*other);
  }
  // Every rank reduces the same units in the same order (the same model runs the same graph).
  // Every stage reduce-scatters: a rank steps only its shard, so it needs only its shard's
  // average (an allreduce would send twice the bytes, and the next forward's all-gather of the
  // parameters on top made stage 1 cost 1.5 times DDP's traffic).
  unit.reduce_output = at::empty({unit.shard_numel}, unit.full.options());
  comm::ReduceScatterOptions options;
  options.op = comm::ReduceOp::kAvg;
  unit.reduce_work = group_->reduce_scatter_tensor(unit.reduce_output, unit.reduce_input, options);
  // The unit's backward is done: its full parameters are not needed again this step.
  free_full(unit);
}

void FullyShardedDataParallel::finish_backward() {
  backward_armed_ = false;
  if (!sync_this_backward_) {
    // no_sync: nothing reduced, the shards unchanged until the synchronised backward and its step.
    for (auto& unit : units_) free_full(*unit);
    return;
  }
  stale_ = true;  // the optimizer is about to change the shards
  // Units some of whose parameters got no gradient: reduced now, in unit order.
  for (auto& unit : units_) {
    if (!unit->reduced) reduce_unit(*unit);
  }
  for (auto& unit : units_) {
    if (unit->reduce_work) complete_reduction(*unit);
    free_full(*unit);
  }
}

void FullyShardedDataParallel::complete_reduction(Unit& unit) {
  torch::NoGradGuard no_grad;
  auto work = std::move(unit.reduce_work);
  unit.reduce_work = nullptr;
  work->wait();
  at::Tensor piece = unit.reduce_output;
  if (unit.shard.grad().defined()) {
    unit.shard.mutable_grad().add_(piece);
  } else {
    unit.shard.mutable_grad() = piece;
  }
  unit.reduce_input = at::Tensor();
  unit.reduce_output = at::Tensor();
}

// ---- no_sync and gradient clipping ---------------------------------------------------------------

FullyShardedDataParallel::NoSyncGuard FullyShardedDataParallel::no_sync() {
  return NoSyncGuard([this](bool enabled) { return std::exchange(grad_sync_, enabled); });
}

double FullyShardedDataParallel::total_grad_norm() {
  SHOAL_CHECK_T(InvalidArgument, !backward_armed_ && grad_sync_,
                "FullyShardedDataParallel: the total gradient norm needs the reduced gradients: "
                "take it (or clip_grad_norm_) after a synchronised backward, outside no_sync()");
  torch::NoGradGuard no_grad;
  // As torch.nn.utils.clip_grad_norm_: each gradient's norm in its own dtype, then the norm of
  // those; the squares summed over the ranks (the shards are disjoint, their padding zero).
  std::vector<at::Tensor> norms;
  for (const auto& unit : units_) {
    const at::Tensor& grad = unit->shard.grad();
    if (grad.defined()) norms.push_back(at::linalg_vector_norm(grad, 2));
  }
  double local = 0;
  if (!norms.empty()) local = at::linalg_vector_norm(at::stack(norms), 2).item<double>();
  at::Tensor squares = at::full({1}, local * local, at::TensorOptions().dtype(at::kDouble));
  group_->allreduce(squares)->wait();
  return std::sqrt(squares.item<double>());
}

double FullyShardedDataParallel::clip_grad_norm_(double max_norm) {
  SHOAL_CHECK_T(InvalidArgument, std::isfinite(max_norm) && max_norm > 0,
                "FullyShardedDataParallel::clip_grad_norm_: max_norm must be a finite number > 0, "
                "got ", max_norm);
  const double total = total_grad_norm();
  SHOAL_CHECK(std::isfinite(total), "[rank ", group_->rank(), "/", group_->size(),
              "] FullyShardedDataParallel::clip_grad_norm_: the total gradient norm is ", total,
              "; the gradients hold NaN or inf (lower the learning rate, or check the data)");
  const double coefficient = std::min(1.0, max_norm / (total + 1e-6));
  if (coefficient < 1) {
    torch::NoGradGuard no_grad;
    for (const auto& unit : units_) {
      const at::Tensor& grad = unit->shard.grad();
      if (grad.defined()) grad.mul_(coefficient);
    }
  }
  return total;
}

// ---- optimizer state ---------------------------------------------------------------------------

std::unique_ptr<torch::optim::Optimizer> optimizer_like(const torch::optim::Optimizer& given,
                                                        std::vector<at::Tensor> params) {
  SHOAL_CHECK_T(InvalidArgument, given.param_groups().size() == 1,
                "FullyShardedDataParallel: the optimizer must have one parameter group, it has ",
                given.param_groups().size());
  const auto& options = given.param_groups().front().options();
  if (const auto* sgd = dynamic_cast<const torch::optim::SGDOptions*>(&options)) {
    return std::make_unique<torch::optim::SGD>(std::move(params), *sgd);
  }
  if (const auto* adam = dynamic_cast<const torch::optim::AdamOptions*>(&options)) {
    return std::make_unique<torch::optim::Adam>(std::move(params), *adam);
  }
  if (const auto* adamw = dynamic_cast<const torch::optim::AdamWOptions*>(&options)) {
    return std::make_unique<torch::optim::AdamW>(std::move(params), *adamw);
  }
  SHOAL_THROW(InvalidArgument, "FullyShardedDataParallel shards the state of SGD, Adam and AdamW; "
              "this optimizer is none of them");
}

namespace {

// The state tensors of one parameter, by field, for the optimizers FSDP shards.
std::vector<at::Tensor> state_fields(torch::optim::OptimizerParamState* state) {
  if (auto* sgd = dynamic_cast<torch::optim::SGDParamState*>(state)) {
    return {sgd->momentum_buffer()};
  }
  if (auto* adam = dynamic_cast<torch::optim::AdamParamState*>(state)) {
    return {adam->exp_avg(), adam->exp_avg_sq(), adam->max_exp_avg_sq()};
  }
  if (auto* adamw = dynamic_cast<torch::optim::AdamWParamState*>(state)) {
    return {adamw->exp_avg(), adamw->exp_avg_sq(), adamw->max_exp_avg_sq()};
  }
  return {};
}

// An Adam or AdamW state (the two are unrelated types with the same fields) holding `fields` and
// `like`'s step.
template <typename State>
std::unique_ptr<torch::optim::OptimizerParamState> make_adam_state(
    const State& like, const std::vector<at::Tensor>& fields) {
  auto state = std::make_unique<State>();
  state->step(like.step());
  state->exp_avg(fields[0]);
  state->exp_avg_sq(fields[1]);
  if (fields[2].defined()) state->max_exp_avg_sq(fields[2]);
  return state;
}

// A state of `like`'s type holding `fields` (as state_fields lists them) and `like`'s step.
std::unique_ptr<torch::optim::OptimizerParamState> make_state(
    torch::optim::OptimizerParamState* like, const std::vector<at::Tensor>& fields) {
  if (dynamic_cast<torch::optim::SGDParamState*>(like) != nullptr) {
    auto state = std::make_unique<torch::optim::SGDParamState>();
    state->momentum_buffer(fields[0]);
    return state;
  }
  if (auto* adam = dynamic_cast<torch::optim::AdamParamState*>(like)) {
    return make_adam_state(*adam, fields);
  }
  auto* adamw = dynamic_cast<torch::optim::AdamWParamState*>(like);
  SHOAL_CHECK(adamw != nullptr, "FullyShardedDataParallel: an optimizer state of an unknown kind");
  return make_adam_state(*adamw, fields);
}

}  // namespace

std::unique_ptr<torch::optim::Optimizer> FullyShardedDataParallel::full_optimizer(
    torch::optim::Optimizer& sharded) {
  torch::NoGradGuard no_grad;
  auto full = optimizer_like(sharded, module_->parameters());
  for (auto& unit_ptr : units_) {
    Unit& unit = *unit_ptr;
    // Every rank has stepped the same number of times: the state exists everywhere or nowhere.
    torch::optim::OptimizerParamState* mine = compat::find_param_state(sharded, unit.shard);
    if (mine == nullptr) continue;
    std::vector<at::Tensor> gathered;
    for (const at::Tensor& field : state_fields(mine)) {
      if (!field.defined()) {
        gathered.emplace_back();
        continue;
      }
      at::Tensor flat = at::empty({unit.padded}, field.options());
      at::Tensor piece = field.contiguous();
      group_->all_gather_into_tensor(flat, piece)->wait();
      gathered.push_back(flat);
    }
    for (size_t i = 0; i < unit.params.size(); ++i) {
      std::vector<at::Tensor> fields;
      for (const at::Tensor& flat : gathered) {
        fields.push_back(flat.defined() ? flat.narrow(0, unit.offsets[i], unit.params[i].numel())
                                              .view(unit.params[i].sizes())
                                              .clone()
                                        : at::Tensor());
      }
      compat::set_param_state(*full, unit.params[i], make_state(mine, fields));
    }
  }
  return full;
}

void FullyShardedDataParallel::load_full_optimizer(torch::optim::Optimizer& full,
                                                   torch::optim::Optimizer& sharded) {
  torch::NoGradGuard no_grad;
  const int64_t rank = group_->rank();
  for (auto& unit_ptr : units_) {
    Unit& unit = *unit_ptr;
    torch::optim::OptimizerParamState* like = nullptr;
    for (const auto& param : unit.params) {
      if ((like = compat::find_param_state(full, param)) != nullptr) break;
    }
    if (like == nullptr) continue;  // nothing saved for this unit (no step yet)
    const size_t count = state_fields(like).size();
    std::vector<at::Tensor> flats(count);
    for (size_t f = 0; f < count; ++f) {
      if (!state_fields(like)[f].defined()) continue;
      flats[f] = at::zeros({unit.padded}, unit.shard.options().requires_grad(false));
      for (size_t i = 0; i < unit.params.size(); ++i) {
        torch::optim::OptimizerParamState* state = compat::find_param_state(full, unit.params[i]);
        if (state == nullptr) continue;  // no state: as zeros (what an unused parameter holds)
        const at::Tensor field = state_fields(state)[f];
        SHOAL_CHECK_T(InvalidArgument, field.defined() && field.numel() == unit.params[i].numel(),
                      "FullyShardedDataParallel: the optimizer state of '", unit.param_names[i],
                      "' does not match the parameter (", unit.params[i].numel(), " elements)");
        flats[f].narrow(0, unit.offsets[i], unit.params[i].numel()).copy_(field.reshape({-1}));
      }
    }
    std::vector<at::Tensor> fields;
    for (const at::Tensor& flat : flats) {
      fields.push_back(flat.defined()
                           ? flat.narrow(0, rank * unit.shard_numel, unit.shard_numel).clone()
                           : at::Tensor());
    }
    compat::set_param_state(sharded, unit.shard, make_state(like, fields));
  }
}

// ---- memory ----------------------------------------------------------------------------------------

FsdpMemoryStats FullyShardedDataParallel::memory_stats() const {
  FsdpMemoryStats stats;
  auto bytes = [](const at::Tensor& t) {
    return t.defined() ? static_cast<int64_t>(t.numel() * t.element_size()) : int64_t{0};
  };
  for (const auto& unit : units_) {
    stats.parameter_bytes += static_cast<int64_t>(compat::storage_bytes(unit->full));
    // Under stages 1-2 the shard is a piece of `full`, counted with it.
    if (!unit->shard.is_alias_of(unit->full)) stats.parameter_bytes += bytes(unit->shard);
    stats.gradient_bytes += bytes(unit->shard.grad()) + bytes(unit->reduce_output) +
                            (unit->grad_buffer.defined() ? bytes(unit->grad_buffer)
                                                         : bytes(unit->reduce_input));
    for (const auto& param : unit->params) stats.gradient_bytes += bytes(param.grad());
  }
  stats.peak_parameter_bytes = std::max(peak_parameter_bytes_, stats.parameter_bytes);
  return stats;
}

void FullyShardedDataParallel::reset_peak_memory_stats() {
  peak_parameter_bytes_ = 0;
  note_parameter_bytes();
}

}  // namespace shoal::parallel
