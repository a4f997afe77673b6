#include "shoal/parallel/distributed_data_parallel.h"

#include <torch/torch.h>

#include <cctype>
#include <cstdlib>
#include <map>
#include <unordered_set>
#include <sstream>

#include "parallel/module_sync.h"
#include "parallel/reducer.h"
#include "parallel/shape_text.h"
#include "shoal/error.h"
#include "shoal/memory/cpu_allocator.h"

namespace shoal::parallel {

bool DistributedDataParallelOptions::debug_detail_from_env() {
  return comm::debug_detail_from_env();
}


// ---- NoSyncGuard -------------------------------------------------------------------------------

NoSyncGuard::NoSyncGuard(std::function<bool(bool)> set_sync) : set_sync_(std::move(set_sync)) {
  previous_ = set_sync_(false);
}

NoSyncGuard::NoSyncGuard(NoSyncGuard&& other) noexcept
    : set_sync_(std::move(other.set_sync_)), previous_(other.previous_) {
  other.set_sync_ = nullptr;
}

NoSyncGuard::~NoSyncGuard() {
  if (set_sync_) set_sync_(previous_);
}

// ---- DDP's join hook ----------------------------------------------------------------------

// PyTorch's _DDPJoinHook: a joined rank shadows the collectives of the active ranks' forward and
// backward; at the end, every rank takes the model of the highest last joiner.
class DdpJoinHook : public JoinHook {
 public:
  explicit DdpJoinHook(DistributedDataParallelBase* ddp) : ddp_(ddp) {}
  void main_hook(const JoinStep& step) override { ddp_->shadow_step(step); }
  void post_hook(bool is_last_joiner) override { ddp_->sync_final_model(is_last_joiner); }

 private:
  DistributedDataParallelBase* ddp_;
};

// ---- DistributedDataParallelBase ---------------------------------------------------------------

DistributedDataParallelBase::DistributedDataParallelBase(std::shared_ptr<torch::nn::Module> module,
                                                         std::shared_ptr<comm::ProcessGroup> group,
                                                         DistributedDataParallelOptions options)
    : base_module_(std::move(module)), group_(std::move(group)), options_(options) {
  SHOAL_CHECK_T(InvalidArgument, base_module_ != nullptr,
                "DistributedDataParallel: the module is null");
  SHOAL_CHECK_T(InvalidArgument, group_ != nullptr,
                "DistributedDataParallel: the process group is null");
  if (options_.tune_cpu_allocator) memory::tune_cpu_allocator();
  std::unordered_set<std::string> ignored(options_.params_and_buffers_to_ignore.begin(),
                                          options_.params_and_buffers_to_ignore.end());
  {
    std::unordered_set<std::string> known;
    for (const auto& item : base_module_->named_parameters(true)) known.insert(item.key());
    for (const auto& item : base_module_->named_buffers(true)) known.insert(item.key());
    for (const auto& name : ignored) {
      SHOAL_CHECK_T(InvalidArgument, known.count(name) > 0, "DistributedDataParallel: '", name,
                    "' in params_and_buffers_to_ignore is no parameter or buffer of the module");
    }
  }
  for (const auto& item : unique_named_parameters(*base_module_)) {
    if (ignored.count(item.key()) == 0) synced_params_.push_back(item.value());
  }
  for (const auto& item : base_module_->named_buffers(true)) {
    if (ignored.count(item.key()) == 0) synced_buffers_.push_back(item.value());
  }
  torch::OrderedDict<std::string, at::Tensor> named;
  for (const auto& item : unique_named_parameters(*base_module_)) {
    if (ignored.count(item.key()) == 0) named.insert(item.key(), item.value());
  }
  verify_same_parameters(*group_, named, "DistributedDataParallel");
  {
    std::vector<at::Tensor> state = synced_params_;
    state.insert(state.end(), synced_buffers_.begin(), synced_buffers_.end());
    broadcast_coalesced(*group_, state);
  }
  // Parameters whose gradients are sparse (PyTorch's expect_sparse_gradient).
  std::unordered_set<const void*> sparse_weights;
  for (const auto& m : base_module_->modules(/*include_self=*/true)) {
    if (auto* e = m->as<torch::nn::EmbeddingImpl>(); e != nullptr && e->options.sparse()) {
      sparse_weights.insert(e->weight.unsafeGetTensorImpl());
    }
    if (auto* e = m->as<torch::nn::EmbeddingBagImpl>(); e != nullptr && e->options.sparse()) {
      sparse_weights.insert(e->weight.unsafeGetTensorImpl());
    }
  }
  std::vector<at::Tensor> params;
  std::vector<std::string> names;
  std::vector<bool> sparse;
  for (const auto& item : named) {
    if (!item.value().requires_grad()) continue;
    params.push_back(item.value());
    names.push_back(item.key());
    sparse.push_back(sparse_weights.count(item.value().unsafeGetTensorImpl()) > 0);
  }
  SHOAL_CHECK_T(InvalidArgument, !params.empty(),
                "DistributedDataParallel: the module has no parameter that requires grad");
  reducer_ = std::make_unique<Reducer>(std::move(params), std::move(names), std::move(sparse),
                                       group_, options_);
}

double parse_bucket_cap_mb(const std::string& text) {
  if (text == "auto") return DistributedDataParallelOptions::kBucketCapAuto;
  char* end = nullptr;
  const double mb = std::strtod(text.c_str(), &end);
  SHOAL_CHECK_T(InvalidArgument,
                end != text.c_str() && *end == '\0' && mb > 0 && mb <= 1e6,
                "--bucket-cap-mb takes a positive number of MiB (at most 1e6) or auto, not '",
                text, "'");
  return mb;
}

DistributedDataParallelBase::~DistributedDataParallelBase() = default;

void DistributedDataParallelBase::prepare_for_forward() {
  if (forward_prepared_) return;  // prepare_for_forward() followed by forward()
  forward_prepared_ = true;
  reducer_->check_parameters_unchanged();
  const bool grad_mode = torch::GradMode::is_enabled();
  // PyTorch's rule: only a grad-mode forward outside no_sync() prepares a synchronised backward;
  // evaluation under NoGradGuard and no_sync() forwards communicate nothing (except the buffer
  // broadcast when the previous forward was synchronised, as in PyTorch).
  const bool sync = grad_mode && reducer_->grad_sync();
  if (join_config().enable) {
    std::optional<JoinStep> notified;
    try {
      notified = Join::notify_join_context(*this, {grad_mode ? 1 : 0, sync ? 1 : 0});
    } catch (...) {
      forward_prepared_ = false;  // throw_on_early_termination: this forward does not run
      throw;
    }
    const JoinFlags flags = join_flags(true, grad_mode, sync, notified);
    // PyTorch's divide_by_initial_world_size = false: average over the ranks with data.
    reducer_->set_gradient_scale(divide_by_initial_world_size_
                                     ? 1.0
                                     : static_cast<double>(group_->size()) / flags.active_ranks);
  }
  if (grad_mode) reducer_->rebuild_buckets();
  if (will_sync_buffers()) broadcast_buffers(/*has_data=*/true);
}

void DistributedDataParallelBase::prepare_for_backward(const at::Tensor& output) {
  prepare_for_backward(std::vector<at::Tensor>{output});
}

void DistributedDataParallelBase::prepare_for_backward(const std::vector<at::Tensor>& outputs) {
  if (!forward_prepared_) prepare_for_forward();
  forward_prepared_ = false;
  if (torch::GradMode::is_enabled() && reducer_->grad_sync()) {
    require_forward_param_sync_ = true;
    reducer_->prepare_for_backward(outputs);
  } else {
    require_forward_param_sync_ = false;
  }
}

void DistributedDataParallelBase::prepare_for_backward_opaque() {
  SHOAL_CHECK_T(InvalidArgument, !options_.find_unused_parameters,
                "DistributedDataParallel: with find_unused_parameters the forward must return a "
                "tensor or a vector of tensors; otherwise call the module yourself and pass its "
                "output tensors to ddp.prepare_for_backward(...)");
  prepare_for_backward(std::vector<at::Tensor>{});
}

bool DistributedDataParallelBase::will_sync_buffers() const {
  return require_forward_param_sync_ && options_.broadcast_buffers && group_->size() > 1 &&
         !synced_buffers_.empty();
}

int DistributedDataParallelBase::find_common_rank(bool candidate) {
  auto rank = torch::full({1}, candidate ? group_->rank() : -1, torch::kInt);
  comm::AllreduceOptions options;
  options.op = comm::ReduceOp::kMax;
  group_->allreduce(rank, options)->wait();
  const int common = rank.item<int>();
  SHOAL_CHECK(common >= 0, group_->rank_prefix(),
              " DistributedDataParallel: no rank qualified as the source of the model");
  return common;
}

void DistributedDataParallelBase::broadcast_buffers(bool has_data) {
  // Inside join, rank 0 may have run out of data and hold stale statistics: the source is the
  // highest rank that still has data (PyTorch's _find_common_rank).
  const int root = join_config().enable ? find_common_rank(has_data) : 0;
  broadcast_coalesced(*group_, synced_buffers_, root);
}

void DistributedDataParallelBase::sync_final_model(bool is_last_joiner) {
  if (group_->size() == 1) return;
  const int root = find_common_rank(is_last_joiner);
  std::vector<at::Tensor> state = synced_params_;
  state.insert(state.end(), synced_buffers_.begin(), synced_buffers_.end());
  broadcast_coalesced(*group_, state, root);
}

DistributedDataParallelBase::JoinFlags DistributedDataParallelBase::join_flags(
    bool has_data, bool grad_mode, bool sync, const std::optional<JoinStep>& notified) {
  JoinStep step;
  if (notified) {
    step = *notified;
  } else {
    // DDP is not the first joinable: its own allreduce, at the same place on every rank (PyTorch
    // spends one on the sync flag here too).
    step = detail::allreduce_join_step(*group_, join_device(), has_data,
                                       {grad_mode ? 1 : 0, sync ? 1 : 0});
  }
  SHOAL_CHECK(step.flags.size() == 2, group_->rank_prefix(),
              " DistributedDataParallel: the join allreduce carried ", step.flags.size(),
              " flags, not DDP's 2");
  return {step.active_ranks, step.flags[0] > 0, step.flags[1] > 0};
}

void DistributedDataParallelBase::shadow_step(const JoinStep& step) {
  const JoinFlags flags = join_flags(false, false, false,
                                     join_config().is_first_joinable ? std::optional<JoinStep>(step)
                                                                     : std::nullopt);
  // Mirror exactly the collectives of the active ranks' step (see the header comment).
  if (flags.grad_mode) reducer_->rebuild_buckets();
  if (will_sync_buffers()) broadcast_buffers(/*has_data=*/false);
  require_forward_param_sync_ = flags.sync;
  if (flags.sync) reducer_->shadow_backward();
}

std::unique_ptr<JoinHook> DistributedDataParallelBase::join_hook(const JoinOptions& options) {
  divide_by_initial_world_size_ = options.divide_by_initial_world_size;
  return std::make_unique<DdpJoinHook>(this);
}

c10::Device DistributedDataParallelBase::join_device() const {
  return synced_params_.empty() ? c10::Device(c10::kCPU) : synced_params_[0].device();
}

NoSyncGuard DistributedDataParallelBase::no_sync() {
  return NoSyncGuard([reducer = reducer_.get()](bool enabled) {
    const bool was = reducer->grad_sync();
    reducer->set_grad_sync(enabled);
    return was;
  });
}

Join DistributedDataParallelBase::join(JoinOptions options) {
  return Join({std::ref<Joinable>(*this)}, options);
}

void DistributedDataParallelBase::register_comm_hook(CommHook hook) {
  reducer_->set_comm_hook(std::move(hook));
}

torch::OrderedDict<std::string, at::Tensor> DistributedDataParallelBase::named_parameters() const {
  return unique_named_parameters(*base_module_);
}

torch::OrderedDict<std::string, at::Tensor> DistributedDataParallelBase::named_buffers() const {
  return base_module_->named_buffers(true);
}

std::vector<at::Tensor> DistributedDataParallelBase::parameters() const {
  return unique_named_parameters(*base_module_).values();
}

ReducerStats DistributedDataParallelBase::stats() const { return reducer_->stats(); }

}  // namespace shoal::parallel
