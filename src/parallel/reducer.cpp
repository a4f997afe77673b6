#include "parallel/reducer.h"

#include <torch/torch.h>

#include <c10/util/strides.h>

#include <algorithm>
#include <cmath>
#include <iomanip>
#include <limits>
#include <map>
#include <sstream>
#include <utility>

#include "parallel/gradient_placement.h"
#include "shoal/comm/init.h"
#include "shoal/error.h"
#include "shoal/launcher/launch.h"
#include "shoal/log.h"
#include "shoal/parallel/comm_hooks.h"
#include "shoal/trace/tracer.h"

namespace shoal::parallel {
namespace {

constexpr double kMiB = 1024.0 * 1024.0;

std::string format_mb(int64_t bytes) {
  std::ostringstream out;
  out << std::fixed << std::setprecision(1) << bytes / 1e6 << " MB";
  return out.str();
}

// Rethrows `error` as the same Shoal error type with `context` in front of its message.
[[noreturn]] void rethrow_with_context(std::exception_ptr error, const std::string& context) {
  try {
    std::rethrow_exception(error);
  } catch (const TimeoutError& e) {
    throw TimeoutError(context + e.what(), e.location());
  } catch (const PeerError& e) {
    throw PeerError(context + e.what(), e.location());
  } catch (const Error& e) {
    throw Error(context + e.what(), e.location());
  } catch (const std::exception& e) {
    throw Error(context + e.what());
  }
}

// The ranks on this host: what the launcher says (torchrun, `shoal run`, mpirun, MPICH, srun:
// comm::detect_rank_info, the one reader of those variables); else all of a shm group's (one
// host by construction); else this one. A launcher environment init would refuse is init's to
// report: here it only falls back to the group.
int local_ranks(const comm::ProcessGroup& group) {
  try {
    const comm::RankInfo info = comm::detect_rank_info();
    if (info.launched) return info.local_world_size;
  } catch (const std::exception&) {
  }
  return group.backend_name() == "shm" ? group.size() : 1;
}

}  // namespace

bool reduces_buckets_inline(const DistributedDataParallelOptions& options,
                            const comm::ProcessGroup& group, bool cpu_parameters) {
  using Mode = DistributedDataParallelOptions::BucketReduction;
  if (options.bucket_reduction != Mode::kAuto) return options.bucket_reduction == Mode::kInline;
  // No spare core: every core already runs a rank's compute, so a communication thread beside
  // it only takes turns with that compute (and the peers wait for whichever is descheduled).
  // Gradients on a GPU are computed there: the cores are not what the two would share.
  return cpu_parameters &&
         static_cast<int64_t>(local_ranks(group)) * at::get_num_threads() >=
             launcher::available_cores();
}

DistributedDataParallelOptions::BucketReduction parse_bucket_reduction(const std::string& text) {
  using Mode = DistributedDataParallelOptions::BucketReduction;
  if (text == "auto") return Mode::kAuto;
  if (text == "overlapped") return Mode::kOverlapped;
  if (text == "inline") return Mode::kInline;
  SHOAL_THROW(InvalidArgument, "--bucket-reduction takes auto, overlapped or inline, not '", text,
              "'");
}

Reducer::Reducer(std::vector<at::Tensor> parameters, std::vector<std::string> names,
                 std::vector<bool> sparse, std::shared_ptr<comm::ProcessGroup> group,
                 const DistributedDataParallelOptions& options)
    : params_(std::move(parameters)),
      names_(std::move(names)),
      sparse_(std::move(sparse)),
      group_(std::move(group)),
      options_(options),
      inline_reduction_(reduces_buckets_inline(
          options_, *group_,
          std::all_of(params_.begin(), params_.end(), [](const at::Tensor& p) { return p.is_cpu(); }))),
      hook_(allreduce_hook(group_, /*async_op=*/!inline_reduction_)) {
  SHOAL_CHECK_T(InvalidArgument, (options_.bucket_cap_mb > 0 || auto_cap()) &&
                                     options_.first_bucket_cap_mb > 0,
                "DistributedDataParallel: bucket_cap_mb (or kBucketCapAuto) and "
                "first_bucket_cap_mb must be positive");
  if (auto_cap()) {
    SHOAL_CHECK_T(InvalidArgument, !options_.bucket_cap_candidates_mb.empty() &&
                                       options_.bucket_cap_tuning_rounds >= 1 &&
                                       options_.bucket_cap_tuning_steps >= 1,
                  "DistributedDataParallel: bucket_cap_mb = auto needs at least one candidate in "
                  "bucket_cap_candidates_mb and bucket_cap_tuning_rounds, "
                  "bucket_cap_tuning_steps >= 1");
    for (double cap : options_.bucket_cap_candidates_mb) {
      SHOAL_CHECK_T(InvalidArgument, cap > 0 && std::isfinite(cap),
                    "DistributedDataParallel: bucket_cap_candidates_mb must be positive, got ", cap);
    }
  }
  ready_.assign(params_.size(), 0);
  handed_.assign(params_.size(),
                 c10::weak_intrusive_ptr<c10::StorageImpl>(c10::intrusive_ptr<c10::StorageImpl>()));
  locally_used_.assign(params_.size(), 0);
  arrived_.assign(params_.size(), 0);
  deferred_.assign(params_.size(), 0);
  result_in_grad_.assign(params_.size(), 0);
  slot_free_.assign(params_.size(), 0);
  for (const auto& p : params_) param_options_.push_back(p.options());
  if (std::all_of(params_.begin(), params_.end(), [](const at::Tensor& p) { return p.is_cpu(); })) {
    lender_ = SlotLender::create(params_.size());
  }
  choose_placement();
  // Gradients arrive roughly in reverse registration order, so the first buckets hold the last
  // parameters and can be reduced while backward still computes the earlier layers' gradients.
  std::vector<size_t> order(params_.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = order.size() - 1 - i;
  // auto starts from PyTorch's default until the rebuild, where the tuning begins.
  build_buckets(order, options_.first_bucket_cap_mb,
                auto_cap() ? DistributedDataParallelOptions().bucket_cap_mb : options_.bucket_cap_mb);
  hooks_.reserve(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    hooks_.push_back(compat::add_grad_accumulated_hook(params_[i], [this, i] { autograd_hook(i); }));
  }
  // find_unused_parameters changes which parameters arrive each iteration, so the arrival order
  // of one iteration says little (PyTorch rebuilds only without it, too).
  if (options_.find_unused_parameters && !options_.static_graph) rebuilt_ = true;
}

Reducer::~Reducer() {
  if (lender_) lender_->disarm();
}

void Reducer::set_comm_hook(CommHook hook) {
  SHOAL_CHECK_T(InvalidArgument, hook != nullptr, "register_comm_hook: the hook is empty");
  SHOAL_CHECK_T(InvalidArgument, stats_.iterations == 0 && !in_backward_,
                "register_comm_hook must be called before the first backward pass");
  hook_ = std::move(hook);
  // A registered hook runs as it is written (its Work may deliver the result only when waited
  // for, as PowerSGD's does): nothing is reduced inline on its behalf, and so no plain gradient
  // lives in a bucket (one handed out at construction, from a .grad the parameter had, moves out).
  inline_reduction_ = false;
  choose_placement();
  for (size_t index = 0; index < params_.size(); ++index) {
    if (auto handed = handed_[index].lock()) move_out_of_slot(index, *handed);
  }
}

std::vector<std::vector<size_t>> Reducer::assign_buckets(const std::vector<size_t>& order,
                                                         double first_cap_mb, double cap_mb) const {
  struct Open {
    std::vector<size_t> variables;
    int64_t bytes = 0;
    bool first = true;
  };
  std::map<at::ScalarType, Open> open;  // one bucket being filled per dtype
  std::vector<std::vector<size_t>> assignment;
  for (size_t index : order) {
    if (sparse_[index]) continue;  // no bucket: reduced on its own (reduce_sparse)
    const auto& p = params_[index];
    Open& bucket = open[p.scalar_type()];
    bucket.variables.push_back(index);
    bucket.bytes += p.numel() * static_cast<int64_t>(p.element_size());
    const double cap = bucket.first ? first_cap_mb : cap_mb;
    if (bucket.bytes >= static_cast<int64_t>(cap * kMiB)) {
      assignment.push_back(std::move(bucket.variables));
      bucket.variables.clear();
      bucket.bytes = 0;
      bucket.first = false;
    }
  }
  for (auto& [dtype, bucket] : open) {
    if (!bucket.variables.empty()) assignment.push_back(std::move(bucket.variables));
  }
  // Reduce buckets in the order their first gradient is expected.
  std::vector<size_t> position(params_.size());
  for (size_t i = 0; i < order.size(); ++i) position[order[i]] = i;
  std::stable_sort(assignment.begin(), assignment.end(),
                   [&](const auto& a, const auto& b) { return position[a[0]] < position[b[0]]; });
  return assignment;
}

void Reducer::build_buckets(const std::vector<size_t>& order, double first_cap_mb, double cap_mb) {
  torch::NoGradGuard no_grad;
  const std::vector<std::vector<size_t>> assignment = assign_buckets(order, first_cap_mb, cap_mb);
  bucket_order_ = order;
  first_cap_mb_ = first_cap_mb;
  cap_mb_ = cap_mb;
  constexpr auto kNoBucket = std::numeric_limits<size_t>::max();

  std::vector<Bucket> buckets(assignment.size());
  locator_.assign(params_.size(), {kNoBucket, 0});
  for (size_t b = 0; b < assignment.size(); ++b) {
    Bucket& bucket = buckets[b];
    bucket.variables = assignment[b];
    int64_t numel = 0;
    for (size_t index : bucket.variables) numel += params_[index].numel();
    const auto& first = params_[bucket.variables[0]];
    // CPU buckets live in the group's symmetric memory where it has some (shm): their
    // allreduce then works in place across the ranks' buckets instead of copying through
    // staging buffers. Every rank builds the same buckets in the same order, as the call needs.
    if (first.device().is_cpu()) {
      bucket.contents = group_->empty_symmetric(numel, first.scalar_type()).zero_();
    } else {
      bucket.contents = torch::zeros({numel}, first.options().requires_grad(false));
    }
    int64_t offset = 0;
    for (size_t slot = 0; slot < bucket.variables.size(); ++slot) {
      const size_t index = bucket.variables[slot];
      auto& param = params_[index];
      // Aliases the bucket's storage without being an autograd view: LibTorch's
      // Optimizer::zero_grad() calls detach_() on every gradient, which views refuse. It has the
      // parameter's memory layout (channels-last stays channels-last, PyTorch's gradient layout
      // contract) when the parameter is dense, else the contiguous one.
      c10::DimVector strides = c10::contiguous_strides(param.sizes());
      if (param.is_non_overlapping_and_dense()) strides = c10::DimVector(param.strides());
      auto view = torch::empty({0}, bucket.contents.options())
                      .set_(bucket.contents.storage(), offset, param.sizes(), strides);
      offset += param.numel();
      if (lender_ && view.nbytes() >= SlotLender::kMinBytes && view.is_non_overlapping_and_dense()) {
        lender_->set_slot(index, view.data_ptr(), view.nbytes(), bucket.contents.storage());
      }
      bucket.views.push_back(view);
      locator_[index] = {b, slot};
      auto& grad = param.mutable_grad();
      if (grad.defined() && placement_->adopt(bucket, slot, index, grad)) {
        stats_.copied_bytes += static_cast<double>(view.nbytes());
      }
    }
    std::vector<at::Tensor> params;
    for (size_t index : bucket.variables) params.push_back(params_[index]);
    bucket.hook_view = std::make_unique<GradBucket>(b, b + 1 == assignment.size(), bucket.contents,
                                                    bucket.views, std::move(params));
    // Its first parameters' names, as many as fit in a hang report's note.
    std::string note = "bucket " + std::to_string(b) + ":";
    for (size_t i = 0; i < bucket.variables.size(); ++i) {
      const std::string& name = names_[bucket.variables[i]];
      if (i > 0 && note.size() + name.size() + 2 >= comm::ProcessGroup::kNoteBytes) {
        note += " ...";
        break;
      }
      note += (i == 0 ? " " : ", ") + name;
    }
    bucket.hook_view->set_note(std::move(note));
  }
  buckets_ = std::move(buckets);
}

void Reducer::rebuild_buckets() {
  if (!synced_once_) return;
  if (rebuilt_) {
    if (auto_cap()) tune_bucket_cap();
    return;
  }
  rebuilt_ = true;
  // Every rank adopts rank 0's order, so the buckets stay identical everywhere. The first element
  // says whether rank 0 saw every gradient arrive (otherwise the buckets stay as they are).
  const int64_t n = static_cast<int64_t>(params_.size());
  auto message = torch::zeros({n + 1}, torch::kLong);
  // Parameters that got no gradient (unused in that step, static_graph) go last, in reverse
  // registration order.
  for (size_t i = params_.size(); i-- > 0;) {
    if (!arrived_[i] && !sparse_[i]) arrival_order_.push_back(i);
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    if (sparse_[i] && !arrived_[i]) arrival_order_.push_back(i);
  }
  if (static_cast<int64_t>(arrival_order_.size()) == n) {
    message[0] = 1;
    for (int64_t i = 0; i < n; ++i) message[i + 1] = static_cast<int64_t>(arrival_order_[i]);
  }
  arrival_order_.clear();
  arrival_order_.shrink_to_fit();
  group_->broadcast(message, {0})->wait();
  if (message[0].item<int64_t>() == 1) {
    std::vector<size_t> order(n);
    auto accessor = message.accessor<int64_t, 1>();
    for (int64_t i = 0; i < n; ++i) order[i] = static_cast<size_t>(accessor[i + 1]);
    // With auto the tuning's first candidate is built right away instead.
    if (!auto_cap()) build_buckets(order, first_cap_mb_, cap_mb_);
    bucket_order_ = std::move(order);
  }
  if (auto_cap()) tune_bucket_cap();
}

void Reducer::tune_bucket_cap() {
  if (!tuner_.started()) {
    const auto layout_of = [this](const BucketCapTuner::Caps& caps) {
      return assign_buckets(bucket_order_, caps.first_mb, caps.cap_mb);
    };
    const BucketCapTuner::Caps first = tuner_.start(layout_of, synced_steps_);
    build_buckets(bucket_order_, first.first_mb, first.cap_mb);
    return;
  }
  if (tuner_.done()) return;
  const std::optional<BucketCapTuner::Caps> next = tuner_.advance(synced_steps_, *group_);
  if (!next) return;
  if (!tuner_.done()) {
    build_buckets(bucket_order_, next->first_mb, next->cap_mb);
    return;
  }
  if (next->first_mb != first_cap_mb_ || next->cap_mb != cap_mb_) {
    build_buckets(bucket_order_, next->first_mb, next->cap_mb);
  }
  if (group_->rank() == 0) {
    log::info("DistributedDataParallel: bucket_cap_mb=auto chose ", next->cap_mb,
              " MiB (first bucket ", next->first_mb, " MiB, ", buckets_.size(), " bucket",
              buckets_.size() == 1 ? "" : "s", ") after ", synced_steps_,
              " synchronised steps (median step time per first/other bucket cap, slowest rank: ",
              tuner_.describe_trials(), ")");
  }
}

void Reducer::prepare_for_backward(const std::vector<at::Tensor>& outputs) {
  if (in_backward_) abandon_backward();
  expect_hooks_ = true;
  ever_prepared_ = true;
  if (lending_) {
    // A slot is free for a new gradient where the parameter has none (zero_grad(set_to_none))
    // and no earlier one handed out there is still alive.
    for (size_t i = 0; i < params_.size(); ++i) {
      slot_free_[i] = !params_[i].grad().defined() && handed_[i].expired();
    }
    lender_->arm(slot_free_);
  }
  if (!tracks_unused()) return;
  std::vector<const compat::GradAccumulatedHook*> hooks;
  for (const auto& h : hooks_) hooks.push_back(h.get());
  auto reachable = compat::reachable_parameters(outputs, hooks);
  unused_.clear();
  for (size_t i = 0; i < reachable.size(); ++i) {
    if (!reachable[i]) unused_.push_back(i);
  }
  unused_known_ = true;
}

void Reducer::autograd_hook(size_t index) {
  if (!(ever_prepared_ ? expect_hooks_ : grad_sync_)) {
    // A no_sync() backward: on PyTorch 2.x a gradient accumulated here makes the parameter
    // locally used in the next synchronised step (its .grad is reduced then); 1.13 forgets it.
    if (no_sync_use_counts_ && params_[index].grad().defined()) locally_used_[index] = 1;
    return;
  }
  if (!in_backward_) {
    begin_backward();
  } else if (!callback_queued_) {
    compat::queue_backward_callback([this] { on_backward_end(); });
    callback_queued_ = true;
  }
  // A hook that fires with an undefined gradient (an output not used in the loss) does not make
  // the parameter "used": its .grad must stay untouched where it is unused on every rank.
  if (params_[index].grad().defined()) locally_used_[index] = 1;
  // The arrival order of the first synchronised backward (no_sync passes do not count: their
  // gradients may be a partial set) drives the one-time bucket rebuild.
  if (!synced_once_ && !rebuilt_ && !arrived_[index]) {
    arrived_[index] = 1;
    arrival_order_.push_back(index);
  }
  mark_ready(index);
}

void Reducer::abandon_backward() {
  // The previous backward ended in an exception (from a user's autograd Function, a comm hook,
  // ...), so its end-of-backward callback never ran. Let the reductions it started finish (every
  // rank that hit the same error started the same ones) and start afresh.
  for (size_t b = 0; b < next_bucket_ && b < buckets_.size(); ++b) {
    if (!buckets_[b].work) continue;
    try {
      buckets_[b].work->wait();
    } catch (...) {
    }
    buckets_[b].work.reset();
  }
  in_backward_ = false;
  callback_queued_ = false;
  expect_hooks_ = false;
  next_bucket_ = 0;
  if (lender_) lender_->disarm();
  std::fill(ready_.begin(), ready_.end(), 0);
  std::fill(locally_used_.begin(), locally_used_.end(), 0);
  std::fill(deferred_.begin(), deferred_.end(), 0);
  std::fill(result_in_grad_.begin(), result_in_grad_.end(), 0);
}

void Reducer::begin_backward() {
  in_backward_ = true;
  backward_start_ = std::chrono::steady_clock::now();
  std::fill(ready_.begin(), ready_.end(), 0);
  std::fill(deferred_.begin(), deferred_.end(), 0);
  std::fill(result_in_grad_.begin(), result_in_grad_.end(), 0);
  // Cleared after each synchronised reduction; what no_sync() passes used since then stays.
  if (!no_sync_use_counts_) std::fill(locally_used_.begin(), locally_used_.end(), 0);
  for (auto& bucket : buckets_) {
    bucket.pending = bucket.variables.size();
    bucket.work.reset();
    bucket.copied_out = false;  // a backward that failed may have left it set
  }
  next_bucket_ = 0;
  compat::queue_backward_callback([this] { on_backward_end(); });
  callback_queued_ = true;
  if (options_.static_graph && static_known_) {
    // static_graph: the parameters unused on every rank in the first iteration, without a walk.
    for (size_t index : static_unused_) mark_ready(index);
  } else if (tracks_unused()) {
    SHOAL_CHECK_T(InvalidArgument, unused_known_, group_->rank_prefix(),
                  " DistributedDataParallel: find_unused_parameters is set but this backward pass "
                  "was not prepared; call ddp.forward(...) or ddp.prepare_for_backward(output) after "
                  "the forward pass");
    unused_known_ = false;
    for (size_t index : unused_) mark_ready(index);
  }
}

void Reducer::mark_ready(size_t index) {
  torch::NoGradGuard no_grad;
  SHOAL_CHECK(!ready_[index], group_->rank_prefix(), " DistributedDataParallel: parameter '",
              names_[index], "' received its gradient twice in one backward pass (used by two "
              "forward passes before one backward, or by a reentrant backward); this is not "
              "supported with gradient synchronisation (use no_sync() for all but the last)");
  ready_[index] = 1;
  if (sparse_[index]) return;  // reduced when backward ends
  auto [b, slot] = locator_[index];
  Bucket& bucket = buckets_[b];
  auto& view = bucket.views[slot];
  auto& param = params_[index];
  // An unused parameter contributes its .grad when it has one (accumulated in earlier no_sync
  // micro-batches, or left from an earlier step without zero_grad), as in PyTorch.
  const auto& grad = param.grad();
  placement_->before_arrival(index, grad);
  const bool in_slot = grad.defined() && lending_ && take_from_lender(index, grad, view);
  if (in_slot) {
    // Computed where it is reduced: nothing to copy.
    stats_.computed_in_bucket_bytes += static_cast<double>(view.nbytes());
    placement_->computed_in_slot(index, grad, view);
  } else if (deferred_[index]) {
    // Nothing yet: it goes through its slot when its bucket is launched (place_deferred).
  } else if (!grad.defined()) {
    view.zero_();
  } else if (!occupies(grad, view)) {
    view.copy_(grad);
    stats_.copied_bytes += static_cast<double>(view.nbytes());
    placement_->copied_in(index, view);
  }
  // Under debug_detail nothing is launched before every rank knows every rank's used set.
  if (--bucket.pending == 0 && !options_.debug_detail) launch_ready_buckets();
}

bool Reducer::take_from_lender(size_t index, const at::Tensor& grad, const at::Tensor& view) {
  const SlotLender::Where where = lender_->learn(index, grad);
  const bool in_slot = where == SlotLender::Where::kOwnSlot && occupies(grad, view);
  // Computed in another parameter's slot (a wrong guess): out, before that slot is written.
  if (where == SlotLender::Where::kOtherSlot) {
    SlotLender::Uncounted uncounted;
    params_[index].mutable_grad() = grad.clone(at::MemoryFormat::Contiguous);
    stats_.copied_bytes += static_cast<double>(view.nbytes());
  }
  if (!in_slot && lender_->lent(index)) {
    // Its slot holds another tensor allocated this step (the graph changed since the step the
    // lender learnt from): it stays there, this gradient goes through the slot only while its
    // bucket is reduced (place_deferred). One that lies in its slot in another layout moves out.
    const auto* begin = static_cast<const char*>(view.data_ptr());
    const auto* memory = static_cast<const char*>(grad.storage().data());
    if (memory + grad.storage().nbytes() > begin && memory < begin + view.nbytes()) {
      SlotLender::Uncounted uncounted;
      params_[index].mutable_grad() = grad.clone(at::MemoryFormat::Contiguous);
    }
    deferred_[index] = 1;
  }
  return in_slot;
}

void Reducer::check_used_on_every_rank() {
  const int world = group_->size();
  at::Tensor mine = torch::empty({static_cast<int64_t>(params_.size())}, torch::kInt);
  auto acc = mine.accessor<int, 1>();
  for (size_t i = 0; i < params_.size(); ++i) acc[i] = ready_[i];
  std::vector<at::Tensor> all;
  for (int r = 0; r < world; ++r) all.push_back(torch::empty_like(mine));
  group_->allgather(all, mine)->wait();
  std::ostringstream report;
  size_t listed = 0;
  size_t unused = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    std::vector<int> without;
    std::vector<int> with;
    for (int r = 0; r < world; ++r) (all[r][static_cast<int64_t>(i)].item<int>() ? with : without).push_back(r);
    if (without.empty()) continue;
    ++unused;
    if (listed++ >= 10) continue;
    const auto ranks = [](const std::vector<int>& list) {
      std::ostringstream text;
      for (size_t k = 0; k < list.size(); ++k) text << (k ? "," : "") << list[k];
      return list.empty() ? std::string("none") : text.str();
    };
    report << (listed > 1 ? "; " : "") << "'" << names_[i] << "' got no gradient on rank(s) "
           << ranks(without) << " (a gradient on rank(s) " << ranks(with) << ")";
  }
  if (unused == 0) return;
  if (unused > 10) report << "; ... (" << unused - 10 << " more)";
  in_backward_ = false;
  expect_hooks_ = false;
  SHOAL_THROW(Error, group_->rank_prefix(), " DistributedDataParallel (SHOAL_DEBUG=detail): ",
              unused, " parameter(s) got no gradient in this backward pass on some rank: ",
              report.str(), ". Every rank must compute gradients for the same parameters: use "
              "them in the loss on every rank, or construct DistributedDataParallel with "
              "find_unused_parameters = true.");
}

void Reducer::launch_ready_buckets() {
  // Buckets are launched strictly in order so every rank issues the same sequence of collectives.
  const bool copy_out_now = placement_->copies_out_on_launch();
  // static_graph (its unused set learnt: tracks_unused() is false): those stay untouched.
  const int* used = options_.static_graph ? static_used_.data() : nullptr;
  while (next_bucket_ < buckets_.size() && buckets_[next_bucket_].pending == 0) {
    Bucket& bucket = buckets_[next_bucket_];
    // Inline, the allreduce blocks this thread: that is the time training waits for it.
    const auto start = inline_reduction_ ? std::chrono::steady_clock::now()
                                         : std::chrono::steady_clock::time_point{};
    auto saved = place_deferred(next_bucket_);
    try {
      bucket.work = launch(next_bucket_);
      if (!saved.empty()) bucket.work->wait();
    } catch (...) {
      for (auto& [index, bytes] : saved) {
        auto [b, slot] = locator_[index];
        buckets_[b].views[slot].copy_(bytes);  // the other tensor's bytes back, result or not
      }
      throw;
    }
    if (!saved.empty()) restore_deferred(next_bucket_, saved);
    if (inline_reduction_) {
      stats_.wait_seconds +=
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    }
    // Inline, the reduction is done: its result is in cache now, and at the end of backward
    // it would be read back from memory. A failed or deferred one is left to finalize_backward.
    if (copy_out_now && bucket.work->is_completed() && !bucket.work->exception()) {
      bucket.copied_out = placement_->copy_out(next_bucket_, used, /*early=*/true);
    }
    ++next_bucket_;
  }
}

void Reducer::choose_placement() {
  // Plain gradients may live in their slots, and be computed there, only where a .grad changes
  // exactly when it did with copies: inline reduction (a bucket's .grads are its average once
  // the hook that fills it returns), no unused parameters to find (their .grads must stay
  // untouched where no rank used them), no debug_detail.
  const bool settled = inline_reduction_ && !options_.debug_detail && !tracks_unused();
  if (options_.gradient_as_bucket_view) {
    placement_ = std::make_unique<ViewPlacement>(*this);
  } else if (settled) {
    placement_ = std::make_unique<SlotPlacement>(*this);
  } else {
    placement_ = std::make_unique<CopyPlacement>(*this);
  }
  lending_ = lender_ != nullptr && settled;
}

std::vector<std::pair<size_t, at::Tensor>> Reducer::place_deferred(size_t bucket_index) {
  std::vector<std::pair<size_t, at::Tensor>> saved;
  Bucket& bucket = buckets_[bucket_index];
  torch::NoGradGuard no_grad;
  for (size_t slot = 0; slot < bucket.variables.size(); ++slot) {
    const size_t index = bucket.variables[slot];
    if (!std::exchange(deferred_[index], 0)) continue;
    auto& view = bucket.views[slot];
    auto& grad = params_[index].mutable_grad();
    if (!lender_->lent(index)) {
      // The other tensor died meanwhile: the ordinary copy.
      view.copy_(grad);
      stats_.copied_bytes += static_cast<double>(view.nbytes());
      placement_->copied_in(index, view);
      continue;
    }
    SlotLender::Uncounted uncounted;
    saved.emplace_back(index, view.clone());
    view.copy_(grad);
    stats_.copied_bytes += 2.0 * static_cast<double>(view.nbytes());
  }
  return saved;
}

void Reducer::restore_deferred(size_t bucket_index,
                               std::vector<std::pair<size_t, at::Tensor>>& saved) {
  torch::NoGradGuard no_grad;
  Bucket& bucket = buckets_[bucket_index];
  for (auto& [index, bytes] : saved) {
    const size_t slot = locator_[index].second;
    auto& view = bucket.views[slot];
    params_[index].mutable_grad().copy_(view);  // the result, in the gradient's own memory
    view.copy_(bytes);                          // and the slot's tensor as it was
    stats_.copied_bytes += 2.0 * static_cast<double>(view.nbytes());
    result_in_grad_[index] = 1;
  }
}

at::Tensor Reducer::slot_gradient(const Bucket& bucket, size_t slot, size_t index) {
  const at::Tensor& view = bucket.views[slot];
  // Its own storage (a plain .grad: not a view, detach_() and set_() work on it, the bucket is
  // not reachable from it) over the slot's bytes; the deleter's context is a reference to the
  // bucket's storage (kept alive with it, no allocation of its own).
  c10::StorageImpl* bucket_storage = bucket.contents.storage().unsafeGetStorageImpl();
  c10::raw::intrusive_ptr::incref(bucket_storage);
  at::DataPtr data(view.data_ptr(), bucket_storage,
                   [](void* ctx) {
                     c10::raw::intrusive_ptr::decref(static_cast<c10::StorageImpl*>(ctx));
                   },
                   view.device());
  c10::Storage storage(c10::Storage::use_byte_size_t(),
                       static_cast<size_t>(view.numel()) * view.element_size(), std::move(data),
                       /*allocator=*/nullptr, /*resizable=*/false);
  handed_[index] = storage.getWeakStorageImpl();
  return at::empty({0}, view.options()).set_(storage, 0, view.sizes(), view.strides());
}

void Reducer::release_slot(size_t index, const at::Tensor& grad) {
  auto handed = handed_[index].lock();
  if (!handed) return;
  // Still the .grad (accumulated into in place): reduced where it is.
  if (grad.defined() && grad.storage().unsafeGetStorageImpl() == handed.get()) return;
  move_out_of_slot(index, *handed);
}

void Reducer::move_out_of_slot(size_t index, c10::StorageImpl& handed) {
  torch::NoGradGuard no_grad;
  handed_[index] = c10::weak_intrusive_ptr<c10::StorageImpl>(c10::intrusive_ptr<c10::StorageImpl>());
  const size_t bytes = handed.nbytes();
  const at::Device device = handed.data_ptr().device();
  at::DataPtr own = c10::GetAllocator(device.type())->allocate(bytes);
  const auto as_bytes = at::TensorOptions().dtype(at::kByte).device(device);
  at::from_blob(own.get(), {static_cast<int64_t>(bytes)}, as_bytes)
      .copy_(at::from_blob(const_cast<void*>(static_cast<const void*>(handed.data())),
                           {static_cast<int64_t>(bytes)}, as_bytes));
  handed.set_data_ptr_noswap(std::move(own));  // the old one's deleter lets the bucket go
  stats_.copied_bytes += static_cast<double>(bytes);
}

std::shared_ptr<comm::Work> Reducer::launch(size_t bucket_index) {
  Bucket& bucket = buckets_[bucket_index];
  bucket.hook_view->buffer() = bucket.contents;  // in case last iteration's hook reassigned it
  trace::begin("allreduce", bucket_index, bucket.contents.numel() * bucket.contents.element_size());
  try {
    auto work = hook_(*bucket.hook_view);
    SHOAL_CHECK(work != nullptr, "the communication hook returned no Work");
    return work;
  } catch (...) {
    rethrow_with_context(std::current_exception(),
                         group_->rank_prefix() + " DistributedDataParallel: starting the reduction of " +
                             describe_bucket(bucket_index) + " failed: ");
  }
}

std::string Reducer::describe_bucket(size_t bucket_index) const {
  const Bucket& bucket = buckets_[bucket_index];
  return "bucket " + std::to_string(bucket_index) + " (" +
         format_mb(bucket.contents.numel() * static_cast<int64_t>(bucket.contents.element_size())) +
         ", " + std::to_string(bucket.variables.size()) + " parameters)";
}

void Reducer::wait_bucket(size_t bucket_index) {
  try {
    Bucket& bucket = buckets_[bucket_index];
    bucket.work->wait();
    trace::end("allreduce", bucket_index);
    // The hook may deliver its result as a new tensor (PyTorch's future value): take it.
    const at::Tensor& result = bucket.hook_view->buffer();
    if (!result.is_same(bucket.contents)) {
      torch::NoGradGuard no_grad;
      bucket.contents.copy_(result.reshape({-1}));
    }
  } catch (...) {
    rethrow_with_context(std::current_exception(),
                         group_->rank_prefix() + " DistributedDataParallel: allreduce of " +
                             describe_bucket(bucket_index) + " failed: ");
  }
}

void Reducer::on_backward_end() {
  callback_queued_ = false;
  if (next_bucket_ < buckets_.size() && compat::in_reentrant_backward()) return;
  finalize_backward();
}

void Reducer::finalize_backward() {
  torch::NoGradGuard no_grad;
  if (lender_) lender_->disarm();
  in_backward_ = false;
  expect_hooks_ = false;
  const auto wait_start = std::chrono::steady_clock::now();
  if (options_.debug_detail) {
    check_used_on_every_rank();
    launch_ready_buckets();
  }
  if (next_bucket_ < buckets_.size()) throw_missing_gradients();
  at::Tensor used_map;
  std::shared_ptr<comm::Work> used_work = start_used_exchange(used_map);
  std::fill(locally_used_.begin(), locally_used_.end(), 0);
  for (const auto& bucket : buckets_) {
    const double bytes = static_cast<double>(bucket.contents.numel() * bucket.contents.element_size());
    stats_.reduced_bytes += bytes;
    // Reduced inline, a bucket was waited for where it filled: nothing of it was hidden.
    if (!inline_reduction_ && bucket.work->is_completed()) stats_.hidden_bytes += bytes;
  }
  for (size_t b = 0; b < buckets_.size(); ++b) wait_bucket(b);
  if (used_work) used_work->wait();
  const auto wait_end = std::chrono::steady_clock::now();
  const double scale = apply_gradient_scale();
  if (used_map.defined()) learn_static_graph(used_map);
  const int* used = used_everywhere(used_map);
  for (size_t index = 0; index < params_.size(); ++index) {
    if (!sparse_[index]) continue;
    reduce_sparse(index, used == nullptr || used[index] != 0, scale, /*shadow=*/false);
  }
  placement_->deliver(used);
  stats_.iterations += 1;
  end_synced_step();
  stats_.wait_seconds += std::chrono::duration<double>(wait_end - wait_start).count();
  stats_.backward_seconds += std::chrono::duration<double>(wait_end - backward_start_).count();
}

void Reducer::throw_missing_gradients() {
  // Wait for what was launched (the other ranks launched it too), then explain, as PyTorch
  // does, instead of leaving the other ranks hanging.
  std::vector<std::string> missing;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!ready_[i]) missing.push_back("'" + names_[i] + "'");
  }
  for (size_t b = 0; b < next_bucket_; ++b) {
    try {
      buckets_[b].work->wait();
    } catch (...) {
    }
  }
  std::ostringstream list;
  for (size_t i = 0; i < missing.size() && i < 10; ++i) list << (i ? ", " : "") << missing[i];
  if (missing.size() > 10) list << ", ... (" << missing.size() - 10 << " more)";
  SHOAL_THROW(Error, group_->rank_prefix(), " DistributedDataParallel: ", missing.size(),
              " parameter(s) received no gradient in this backward pass, so their buckets were "
              "never reduced: ", list.str(), ". This happens when parameters are not used to "
              "compute the loss on this step (construct DistributedDataParallel with "
              "find_unused_parameters = true, and make sure the forward's output is passed to "
              "ddp.forward or ddp.prepare_for_backward), or when the outputs of a forward are "
              "not all used in the loss. Every rank must compute gradients for the same "
              "parameters.");
}

std::shared_ptr<comm::Work> Reducer::start_used_exchange(at::Tensor& used_map) {
  if (!tracks_unused()) return nullptr;
  used_map = torch::empty({static_cast<int64_t>(params_.size())}, torch::kInt);
  auto acc = used_map.accessor<int, 1>();
  for (size_t i = 0; i < params_.size(); ++i) acc[i] = locally_used_[i];
  return group_->allreduce(used_map);
}

double Reducer::apply_gradient_scale() {
  const double scale = std::exchange(gradient_scale_, 1.0);
  if (scale == 1.0) return scale;
  for (auto& bucket : buckets_) bucket.contents.mul_(scale);  // none copied out (scale 1 only)
  for (size_t i = 0; i < params_.size(); ++i) {
    if (result_in_grad_[i]) params_[i].mutable_grad().mul_(scale);
  }
  return scale;
}

const int* Reducer::used_everywhere(const at::Tensor& used_map) const {
  if (options_.static_graph) return static_used_.data();
  return used_map.defined() ? used_map.data_ptr<int>() : nullptr;
}

void Reducer::end_synced_step() {
  ++synced_steps_;
  tuner_.backward_ended();
  synced_once_ = true;
}

void Reducer::reduce_sparse(size_t index, bool used_somewhere, double scale, bool shadow) {
  // Every rank reaches this for the same parameters in the same order (parameter order, after
  // the dense buckets), so the collectives match. Unused on every rank: .grad left alone.
  if (!used_somewhere) return;
  auto& param = params_[index];
  const std::string context = group_->rank_prefix() + " DistributedDataParallel: sparse gradient "
                              "of '" + names_[index] + "': ";
  try {
    const int64_t sparse_dims = 1;
    at::Tensor grad = shadow ? at::Tensor() : param.grad();  // a joined rank sends nothing
    at::Tensor indices, values;
    if (grad.defined()) {
      SHOAL_CHECK_T(InvalidArgument, grad.is_sparse() && grad.sparse_dim() == sparse_dims,
                    "expected a sparse COO gradient with one sparse dimension (Embedding), got ",
                    grad.is_sparse() ? "another sparse layout" : "a dense gradient");
      auto coalesced = grad.coalesce();
      indices = coalesced._indices();
      values = coalesced._values();
    } else {
      auto value_shape = param.sizes().vec();
      value_shape[0] = 0;
      indices = torch::zeros({sparse_dims, 0}, torch::kLong);
      values = torch::zeros(value_shape, param.options().requires_grad(false));
    }
    // Gather every rank's count, then indices and values padded to the largest count.
    const int world = group_->size();
    auto count = torch::full({1}, indices.size(1), torch::kLong);
    std::vector<at::Tensor> counts(world);
    for (auto& c : counts) c = torch::empty_like(count);
    group_->allgather(counts, count)->wait();
    int64_t largest = 0;
    for (const auto& c : counts) largest = std::max(largest, c.item<int64_t>());
    auto pad = [largest](const at::Tensor& t, int64_t dim) {
      auto shape = t.sizes().vec();
      shape[dim] = largest;
      auto padded = torch::zeros(shape, t.options());
      padded.narrow(dim, 0, t.size(dim)).copy_(t);
      return padded;
    };
    auto my_indices = pad(indices, 1), my_values = pad(values.contiguous(), 0);
    std::vector<at::Tensor> all_indices(world), all_values(world);
    for (auto& t : all_indices) t = torch::empty_like(my_indices);
    for (auto& t : all_values) t = torch::empty_like(my_values);
    group_->allgather(all_indices, my_indices)->wait();
    group_->allgather(all_values, my_values)->wait();
    std::vector<at::Tensor> index_parts, value_parts;
    for (int r = 0; r < world; ++r) {
      const int64_t n = counts[r].item<int64_t>();
      index_parts.push_back(all_indices[r].narrow(1, 0, n));
      value_parts.push_back(all_values[r].narrow(0, 0, n));
    }
    auto sum = torch::sparse_coo_tensor(torch::cat(index_parts, 1), torch::cat(value_parts, 0),
                                        param.sizes(), values.options().layout(at::kSparse))
                   .coalesce();
    if (!shadow) param.mutable_grad() = sum.mul_(scale / static_cast<double>(world));
  } catch (...) {
    rethrow_with_context(std::current_exception(), context);
  }
}

void Reducer::shadow_backward() {
  torch::NoGradGuard no_grad;
  // The buckets themselves (on shm they live in symmetric memory, which every rank's reduction
  // must use), zeroed for the reduction and restored afterwards: with gradient_as_bucket_view
  // they are this rank's .grad, which a joined rank keeps (PyTorch reduces zeros without touching
  // the parameters).
  std::vector<at::Tensor> saved;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    saved.push_back(buckets_[b].contents.clone());
    buckets_[b].contents.zero_();
    buckets_[b].work = launch(b);
  }
  std::shared_ptr<comm::Work> used_work;
  at::Tensor used_map;
  if (tracks_unused()) {
    used_map = torch::zeros({static_cast<int64_t>(params_.size())}, torch::kInt);
    used_work = group_->allreduce(used_map);
  }
  for (size_t b = 0; b < buckets_.size(); ++b) wait_bucket(b);
  for (size_t b = 0; b < buckets_.size(); ++b) buckets_[b].contents.copy_(saved[b]);
  if (used_work) used_work->wait();
  if (used_map.defined()) learn_static_graph(used_map);
  const int* used = used_everywhere(used_map);
  for (size_t index = 0; index < params_.size(); ++index) {
    if (!sparse_[index]) continue;
    reduce_sparse(index, used == nullptr || used[index] != 0, 1.0, /*shadow=*/true);
  }
  end_synced_step();
}

bool Reducer::tracks_unused() const {
  return options_.static_graph ? !static_known_ : options_.find_unused_parameters;
}

void Reducer::learn_static_graph(const at::Tensor& used_map) {
  if (!options_.static_graph || static_known_) return;
  static_known_ = true;
  choose_placement();  // tracks_unused() is false from now on
  auto acc = used_map.accessor<int, 1>();
  static_used_.assign(params_.size(), 0);
  for (size_t i = 0; i < params_.size(); ++i) {
    static_used_[i] = acc[i];
    if (acc[i] == 0) static_unused_.push_back(i);
  }
}

void Reducer::check_parameters_unchanged() const {
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& now = params_[i];
    const auto& then = param_options_[i];
    if (now.scalar_type() == then.dtype().toScalarType() && now.device() == then.device()) continue;
    SHOAL_THROW(InvalidArgument, group_->rank_prefix(), " DistributedDataParallel: parameter '",
                names_[i], "' changed from ", c10::toString(then.dtype().toScalarType()), " on ",
                then.device().str(),
                " to ", c10::toString(now.scalar_type()), " on ", now.device().str(),
                " after DDP was constructed (module->to(...) after wrapping: LibTorch drops the "
                "gradient hooks DDP placed, and its buckets keep the old type). Move or convert "
                "the module first, then construct DistributedDataParallel.");
  }
}

ReducerStats Reducer::stats() const {
  ReducerStats stats = stats_;
  stats.static_graph = options_.static_graph;
  stats.unused_parameters = static_cast<int64_t>(options_.static_graph ? static_unused_.size()
                                                                      : unused_.size());
  stats.bucket_cap_mb = cap_mb_;
  stats.first_bucket_cap_mb = first_cap_mb_;
  stats.bucket_cap_auto = auto_cap();
  stats.inline_reduction = inline_reduction_;
  stats.bucket_cap_tuning = auto_cap() && !tuner_.done();
  stats.bucket_cap_trials = tuner_.trials();
  stats.bucket_bytes.clear();
  for (const auto& bucket : buckets_) {
    stats.bucket_bytes.push_back(bucket.contents.numel() *
                                 static_cast<int64_t>(bucket.contents.element_size()));
  }
  return stats;
}

}  // namespace shoal::parallel
