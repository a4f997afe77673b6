#include "shoal/parallel/distributed_data_parallel.h"

#include <torch/torch.h>

#include <cctype>
#include <cstdlib>
#include <map>
#include <unordered_set>
#include <sstream>

#include "parallel/reducer.h"
#include "parallel/shape_text.h"
#include "shoal/error.h"
#include "shoal/memory/cpu_allocator.h"

namespace shoal::parallel {

bool DistributedDataParallelOptions::debug_detail_from_env() {
  const char* value = std::getenv("SHOAL_DEBUG");
  if (value == nullptr) return false;
  std::string level(value);
  for (char& c : level) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return level == "detail";
}

namespace {

// Room for one parameter's description when ranks disagree ("name\tshape\tdtype").
constexpr int64_t kDescriptionBytes = 512;

std::string describe(const std::string& name, const at::Tensor& t) {
  return name + "\t" + shape_of(t) + "\t" + std::string(c10::toString(t.scalar_type())) + "\t" +
         (t.requires_grad() ? "grad" : "nograd");
}

// FNV-1a: the same value in every process of the same program, unlike std::hash's contract.
int64_t fnv1a(const std::string& text, uint64_t hash = 1469598103934665603ull) {
  for (unsigned char c : text) {
    hash ^= c;
    hash *= 1099511628211ull;
  }
  return static_cast<int64_t>(hash >> 1);
}

// The module's parameters, each tensor once under its first name (tied weights: one tensor
// registered under two names is reduced once, as PyTorch deduplicates by identity).
torch::OrderedDict<std::string, at::Tensor> unique_named_parameters(
    const torch::nn::Module& module) {
  torch::OrderedDict<std::string, at::Tensor> unique;
  std::unordered_set<const void*> seen;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    if (seen.insert(item.value().unsafeGetTensorImpl()).second) {
      unique.insert(item.key(), item.value());
    }
  }
  return unique;
}

std::vector<at::Tensor> allgather(comm::ProcessGroup& group, const at::Tensor& input) {
  std::vector<at::Tensor> outputs;
  for (int r = 0; r < group.size(); ++r) outputs.push_back(torch::empty_like(input));
  group.allgather(outputs, input)->wait();
  return outputs;
}

std::vector<std::string> split_tabs(const std::string& text) {
  std::vector<std::string> parts;
  std::istringstream in(text);
  std::string part;
  while (std::getline(in, part, '\t')) parts.push_back(part);
  parts.resize(4);
  return parts;
}

// Checks that every rank holds the same parameters; on a mismatch every rank throws the same
// message naming the first parameter that differs and how.
void verify_same_parameters(comm::ProcessGroup& group,
                            const torch::OrderedDict<std::string, at::Tensor>& named) {
  std::vector<std::string> descriptions;
  uint64_t hash = 1469598103934665603ull;
  for (const auto& item : named) {
    descriptions.push_back(describe(item.key(), item.value()));
    hash = static_cast<uint64_t>(fnv1a(descriptions.back(), hash));
  }
  auto summary = torch::tensor({static_cast<int64_t>(hash), static_cast<int64_t>(named.size())},
                               torch::kLong);
  auto summaries = allgather(group, summary);
  int64_t max_count = 0;
  bool same = true;
  for (const auto& s : summaries) {
    same = same && torch::equal(s, summaries[0]);
    max_count = std::max(max_count, s[1].item<int64_t>());
  }
  if (same) return;

  // Find the first parameter index whose description differs on some rank.
  auto hashes = torch::full({max_count}, -1, torch::kLong);
  for (size_t i = 0; i < descriptions.size(); ++i) hashes[i] = fnv1a(descriptions[i]);
  auto all_hashes = allgather(group, hashes);
  int64_t index = 0;
  int other = 1;
  for (; index < max_count; ++index) {
    bool found = false;
    for (int r = 1; r < group.size() && !found; ++r) {
      if (all_hashes[r][index].item<int64_t>() != all_hashes[0][index].item<int64_t>()) {
        other = r;
        found = true;
      }
    }
    if (found) break;
  }
  auto text = torch::zeros({kDescriptionBytes}, torch::kByte);
  if (index < static_cast<int64_t>(descriptions.size())) {
    const auto& d = descriptions[index];
    std::memcpy(text.data_ptr(), d.data(), std::min<size_t>(d.size(), kDescriptionBytes - 1));
  }
  auto texts = allgather(group, text);
  auto read = [&](int r) {
    return split_tabs(std::string(static_cast<const char*>(texts[r].data_ptr())));
  };
  auto a = read(0), b = read(other);
  std::ostringstream why;
  why << group.rank_prefix() << " DistributedDataParallel: the model differs between ranks: ";
  if (a[0].empty() || b[0].empty()) {
    why << "rank 0 has " << summaries[0][1].item<int64_t>() << " parameters but rank " << other
        << " has " << summaries[other][1].item<int64_t>();
  } else if (a[0] != b[0]) {
    why << "parameter #" << index << " is '" << a[0] << "' on rank 0 but '" << b[0] << "' on rank "
        << other;
  } else if (a[1] != b[1]) {
    why << "parameter '" << a[0] << "' has shape " << a[1] << " on rank 0 but " << b[1]
        << " on rank " << other;
  } else if (a[2] != b[2]) {
    why << "parameter '" << a[0] << "' has dtype " << a[2] << " on rank 0 but " << b[2]
        << " on rank " << other;
  } else {
    why << "parameter '" << a[0] << "' requires grad on one of rank 0 and rank " << other
        << " but not on the other";
  }
  why << "; every rank must construct the same model";
  throw InvalidArgument(why.str());
}

// Broadcasts rank `root`'s tensors to every rank, one collective per dtype.
void broadcast_coalesced(comm::ProcessGroup& group, const std::vector<at::Tensor>& tensors,
                         int root = 0) {
  torch::NoGradGuard no_grad;
  std::map<at::ScalarType, std::vector<at::Tensor>> by_type;
  for (const auto& t : tensors) {
    if (t.defined() && t.numel() > 0) by_type[t.scalar_type()].push_back(t);
  }
  for (auto& [type, list] : by_type) {
    std::vector<at::Tensor> flat;
    for (const auto& t : list) flat.push_back(t.reshape({-1}));
    auto buffer = torch::cat(flat);
    comm::BroadcastOptions options;
    options.root = root;
    group.broadcast(buffer, options)->wait();
    int64_t offset = 0;
    for (auto& t : list) {
      t.copy_(buffer.narrow(0, offset, t.numel()).view(t.sizes()));
      offset += t.numel();
    }
  }
}

}  // namespace

// ---- NoSyncGuard -------------------------------------------------------------------------------

NoSyncGuard::NoSyncGuard(Reducer* reducer) : reducer_(reducer) {
  previous_ = reducer_->grad_sync();
  reducer_->set_grad_sync(false);
}

NoSyncGuard::NoSyncGuard(NoSyncGuard&& other) noexcept
    : reducer_(other.reducer_), previous_(other.previous_) {
  other.reducer_ = nullptr;
}

NoSyncGuard::~NoSyncGuard() {
  if (reducer_ != nullptr) reducer_->set_grad_sync(previous_);
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
  verify_same_parameters(*group_, named);
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

NoSyncGuard DistributedDataParallelBase::no_sync() { return NoSyncGuard(reducer_.get()); }

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
