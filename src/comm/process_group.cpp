#include "shoal/comm/process_group.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cctype>
#include <cstring>

#include "comm/hang_reporter.h"
#include "comm/host_staging.h"
#include "shoal/comm/flight_recorder.h"
#include "shoal/comm/store.h"
#include "shoal/env.h"
#include "shoal/error.h"

namespace shoal::comm {
namespace {

bool is_supported_dtype(at::ScalarType type) {
  switch (type) {
    case at::kFloat:
    case at::kDouble:
    case at::kHalf:
    case at::kBFloat16:
    case at::kInt:
    case at::kLong:
    case at::kByte:
    case at::kChar:
      return true;
    default:
      return false;
  }
}

// SHOAL_CHECK_COLLECTIVES=1 or 0 decides; unset, the checks follow SHOAL_DEBUG=detail.
bool collective_checks_from_env() {
  const std::optional<bool> set = env::flag_if_set(env::Var::kCheckCollectives);
  return set ? *set : debug_detail_from_env();
}

}  // namespace

ProcessGroup::ProcessGroup(int rank, int size, Milliseconds timeout)
    : rank_(rank), size_(size), timeout_(timeout) {
  SHOAL_CHECK_T(InvalidArgument, size >= 1, "world size must be at least 1, got ", size);
  SHOAL_CHECK_T(InvalidArgument, rank >= 0 && rank < size, "rank ", rank,
                " is out of range for world size ", size, "; ranks are 0..", size - 1);
  SHOAL_CHECK_T(InvalidArgument, timeout.count() > 0, "time-out must be positive, got ",
                timeout.count(), " ms");
  check_collectives_ = collective_checks_from_env();
  register_process_group(this);
}

bool debug_detail_from_env() {
  return env::choice(env::Var::kDebug) == "detail";
}

ProcessGroup::~ProcessGroup() {
  if (hang_reporter_) hang_reporter_->close();  // no summary of this group is made after this
  unregister_process_group(this);
}

void ProcessGroup::enable_hang_reports(std::shared_ptr<Store> store, const std::string& scope,
                                       std::vector<int> job_ranks) {
  if (store == nullptr || hang_reporter_) return;
  hang_reporter_ = HangReporter::create(std::move(store), scope, rank_, size_, [this] {
    // The newest operation noted, and the newest whose Work has completed or is gone. The slots
    // are copied first: Work::is_completed() is not called under recent_mutex_.
    std::vector<Recorded> ops;
    {
      std::lock_guard<std::mutex> lock(recent_mutex_);
      const uint64_t count = std::min<uint64_t>(newest_recorded_, kRecentOperations);
      for (uint64_t seq = newest_recorded_ + 1 - count; seq <= newest_recorded_ && count > 0;
           ++seq) {
        const Recorded& slot = recent_[seq % kRecentOperations];
        if (slot.label.sequence == seq) ops.push_back(slot);
      }
    }
    RankSummary summary;
    if (ops.empty()) {
      summary.text = "no operation yet";
      return summary;
    }
    const Recorded* completed = nullptr;
    for (const Recorded& op : ops) {
      const auto work = op.work.lock();
      if (op.attached && (!work || work->is_completed())) completed = &op;
    }
    const Recorded& started = ops.back();
    char age[64];
    if (&started == completed) {
      std::snprintf(age, sizeof age, "completed");
    } else {
      std::snprintf(age, sizeof age, "in flight for %.1f s",
                    std::chrono::duration<double>(std::chrono::steady_clock::now() -
                                                  started.start).count());
    }
    summary.last_started = started.label.sequence;
    summary.text = "started " + started.describe() + ", " + age;
    if (completed != nullptr) {
      summary.last_completed = completed->label.sequence;
      if (completed != &started) summary.text += "; completed " + completed->describe();
    } else {
      summary.text += "; none of its last " + std::to_string(ops.size()) + " completed";
    }
    return summary;
  }, std::move(job_ranks));
}

std::string ProcessGroup::hang_report() const {
  return hang_reporter_ ? hang_reporter_->gather() : std::string();
}

std::string ProcessGroup::rank_prefix() const { return comm::rank_prefix(rank_, size_); }

std::string ProcessGroup::Recorded::describe() const {
  std::string text = label.description();
  if (note[0] != '\0') text += std::string(" [") + note + "]";
  return text;
}

ProcessGroup::Recorded* ProcessGroup::recent_slot(uint64_t sequence) {
  Recorded& slot = recent_[sequence % kRecentOperations];
  return slot.label.sequence == sequence ? &slot : nullptr;
}

std::shared_ptr<Work> ProcessGroup::record(const OpContext& ctx, std::shared_ptr<Work> work) {
  std::lock_guard<std::mutex> lock(recent_mutex_);
  // The label make_context noted lacks what the caller filled in since (root, reduce op, peer).
  if (Recorded* slot = recent_slot(ctx.sequence())) {
    slot->label = ctx.label;
    slot->work = work;
    slot->attached = true;
  }
  return work;
}

std::vector<std::string> ProcessGroup::recent_operations() const {
  std::vector<Recorded> copy;
  {
    std::lock_guard<std::mutex> lock(recent_mutex_);
    const uint64_t count = std::min<uint64_t>(newest_recorded_, kRecentOperations);
    for (uint64_t seq = newest_recorded_ + 1 - count; seq <= newest_recorded_ && count > 0; ++seq) {
      const Recorded& slot = recent_[seq % kRecentOperations];
      if (slot.label.sequence == seq) copy.push_back(slot);
    }
  }
  const auto now = std::chrono::steady_clock::now();
  std::vector<std::string> out;
  for (const Recorded& op : copy) {
    const auto work = op.work.lock();
    char state[64];
    if (op.attached && !work) {
      std::snprintf(state, sizeof state, "released");  // its Work is gone: waited for, or dropped
    } else if (!op.attached || !work->is_completed()) {
      std::snprintf(state, sizeof state, "in flight for %.1f s",
                    std::chrono::duration<double>(now - op.start).count());
    } else {
      std::snprintf(state, sizeof state, "done");
    }
    out.push_back(op.describe() + ": " + state);
  }
  return out;
}

OpContext ProcessGroup::make_context(const char* name, Milliseconds timeout,
                                     const at::Tensor* tensor) {
  OpContext ctx;
  ctx.label.sequence = ++sequence_;  // taken even by a call refused below, as on the other ranks
  ctx.timeout = timeout == kGroupTimeout ? timeout_ : timeout;
  SHOAL_CHECK_T(InvalidArgument, ctx.timeout.count() > 0, rank_prefix(), " ", name,
                ": time-out must be positive, got ", ctx.timeout.count(), " ms");
  ctx.label.name = name;
  ctx.label.rank = rank_;
  ctx.label.size = size_;
  if (tensor != nullptr) {
    ctx.label.numel = tensor->numel();
    ctx.label.dtype = tensor->scalar_type();
    ctx.label.device = tensor->device().type();
  }
  // Noted now, not when its Work exists: a rank stuck in the collective check (or in a backend
  // that blocks before returning a Work) shows the operation in flight.
  std::lock_guard<std::mutex> lock(recent_mutex_);
  recent_[ctx.label.sequence % kRecentOperations] = {ctx.label, std::chrono::steady_clock::now(),
                                                     {}, false};
  newest_recorded_ = std::max(newest_recorded_, ctx.label.sequence);
  return ctx;
}

namespace {

void check_tensor(const ProcessGroup& pg, const char* op, const at::Tensor& tensor,
                  const char* what = "tensor") {
  SHOAL_CHECK_T(InvalidArgument, tensor.defined(), pg.rank_prefix(), " ", op, ": the ", what,
                " is undefined; pass an allocated tensor");
  SHOAL_CHECK_T(InvalidArgument, tensor.layout() == at::kStrided, pg.rank_prefix(), " ", op,
                ": the ", what, " is sparse; only dense tensors can be communicated");
  SHOAL_CHECK_T(InvalidArgument, is_supported_dtype(tensor.scalar_type()), pg.rank_prefix(), " ",
                op, ": dtype ", c10::toString(tensor.scalar_type()),
                " is not supported; use float32, float64, float16, bfloat16, int32, int64, "
                "uint8 or int8");
  SHOAL_CHECK_T(InvalidArgument, tensor.device().is_cpu() || tensor.is_cuda(), pg.rank_prefix(), " ",
                op, ": the ", what, " is on ", tensor.device().str(),
                "; only CPU and CUDA tensors can be communicated");
  SHOAL_CHECK_T(InvalidArgument, tensor.is_contiguous(), pg.rank_prefix(), " ", op, ": the ",
                what, " (sizes ", tensor.sizes(), ", strides ", tensor.strides(),
                ") is not contiguous; call .contiguous() first and copy the result back");
}

void check_rank(const ProcessGroup& pg, const char* op, int peer, const char* role) {
  SHOAL_CHECK_T(InvalidArgument, peer >= 0 && peer < pg.size(), pg.rank_prefix(), " ", op, ": ",
                role, " rank ", peer, " is out of range; ranks are 0..", pg.size() - 1);
}

void check_list(const ProcessGroup& pg, const char* op, const std::vector<at::Tensor>& list,
                const at::Tensor& like, const char* what) {
  SHOAL_CHECK_T(InvalidArgument, static_cast<int>(list.size()) == pg.size(), pg.rank_prefix(), " ",
                op, ": ", what, " must hold one tensor per rank (", pg.size(), "), got ",
                list.size());
  for (size_t i = 0; i < list.size(); ++i) {
    check_tensor(pg, op, list[i], what);
    SHOAL_CHECK_T(InvalidArgument,
                  list[i].sizes() == like.sizes() && list[i].scalar_type() == like.scalar_type(),
                  pg.rank_prefix(), " ", op, ": ", what, "[", i, "] is ", list[i].sizes(), " ",
                  c10::toString(list[i].scalar_type()), " but must match ", like.sizes(), " ",
                  c10::toString(like.scalar_type()));
  }
}

}  // namespace

namespace {

// The collectives a fingerprint can name, by code (the index).
constexpr const char* kCollectiveNames[] = {"allreduce", "broadcast", "reduce",  "allgather",
                                            "reduce_scatter", "gather", "scatter", "barrier"};
constexpr int kCollectiveCount = sizeof kCollectiveNames / sizeof kCollectiveNames[0];

// What every rank must agree on for one collective (the sequence number is shown, not compared:
// point-to-point operations are numbered too, and only the pair involved sees them).
struct Fingerprint {
  enum Field { kOp, kSequence, kNumel, kDtype, kDevice, kRoot, kReduceOp, kFields };
  int64_t field[kFields] = {0, 0, 0, -1, 0, -1, -1};

  bool same_collective(const Fingerprint& other) const {
    // The device type too: a multi-device group sends a CPU and a CUDA tensor to different
    // backends, so ranks that disagree on it would wait for each other until the time-out.
    for (int f : {kOp, kNumel, kDtype, kDevice, kRoot, kReduceOp}) {
      if (field[f] != other.field[f]) return false;
    }
    return true;
  }

  // "broadcast #7 (8.0 kB float32, root 0)", as the operation's own description reads.
  std::string describe() const {
    const int64_t op = field[kOp];
    if (op < 0 || op >= kCollectiveCount) return "an unknown operation";
    OpLabel label;
    label.name = kCollectiveNames[op];
    label.sequence = static_cast<uint64_t>(field[kSequence]);
    if (field[kDtype] >= 0) {
      label.numel = field[kNumel];
      label.dtype = static_cast<at::ScalarType>(field[kDtype]);
      label.device = static_cast<c10::DeviceType>(field[kDevice]);
    }
    label.reduce_op = static_cast<int>(field[kReduceOp]);
    label.root = static_cast<int>(field[kRoot]);
    return label.description();
  }
};

int collective_code(const char* name) {
  for (int i = 0; i < kCollectiveCount; ++i) {
    if (std::strcmp(kCollectiveNames[i], name) == 0) return i;
  }
  return -1;
}

std::shared_ptr<Work> failed_work(const OpContext& ctx, std::exception_ptr error) {
  auto work = std::make_shared<PromiseWork>(ctx.label, ctx.timeout);
  work->finish_with_error(std::move(error));
  return work;
}

// async_op = false: the caller gets the operation done, or its error thrown, as from
// torch.distributed's async_op=False.
std::shared_ptr<Work> completed_if_sync(const OpContext& ctx, std::shared_ptr<Work> work) {
  if (!ctx.async_op) work->wait();
  return work;
}

}  // namespace

void ProcessGroup::record_failure(const OpContext& ctx, std::exception_ptr error) {
  record(ctx, failed_work(ctx, std::move(error)));  // listed as released, never "in flight"
}

std::shared_ptr<Work> ProcessGroup::check_same_collective(const OpContext& ctx) {
  {
    // The caller has filled in the root and reduce op since make_context noted the operation.
    std::lock_guard<std::mutex> lock(recent_mutex_);
    if (Recorded* slot = recent_slot(ctx.sequence())) slot->label = ctx.label;
  }
  if (!check_collectives_ || size_ == 1) return nullptr;
  const OpLabel& label = ctx.label;
  Fingerprint mine;
  mine.field[Fingerprint::kOp] = collective_code(ctx.name());
  mine.field[Fingerprint::kSequence] = static_cast<int64_t>(ctx.sequence());
  if (label.numel >= 0) {
    mine.field[Fingerprint::kNumel] = label.numel;
    mine.field[Fingerprint::kDtype] = static_cast<int64_t>(label.dtype);
    mine.field[Fingerprint::kDevice] = static_cast<int64_t>(label.device);
  }
  mine.field[Fingerprint::kRoot] = label.root;
  mine.field[Fingerprint::kReduceOp] = label.reduce_op;

  if (!fingerprint_in_.defined()) {
    fingerprint_in_ = at::empty({Fingerprint::kFields}, at::kLong);
    for (int r = 0; r < size_; ++r) {
      fingerprint_all_.push_back(at::empty({Fingerprint::kFields}, at::kLong));
    }
  }
  at::Tensor& input = fingerprint_in_;
  std::vector<at::Tensor>& all = fingerprint_all_;
  std::memcpy(input.data_ptr<int64_t>(), mine.field, sizeof mine.field);
  try {
    // Under the collective's own context, so that a rank that never comes is reported as this
    // collective timing out, naming that rank.
    run_allgather(all, input, ctx)->wait();
  } catch (...) {
    return failed_work(ctx, std::current_exception());
  }
  for (int r = 0; r < size_; ++r) {
    Fingerprint theirs;
    std::memcpy(theirs.field, all[r].data_ptr<int64_t>(), sizeof theirs.field);
    if (!theirs.same_collective(mine)) {
      const std::string message = detail::str_cat(
          ctx.prefix(), " does not match rank ", r, "'s ", theirs.describe(),
          ": every rank must issue the same collectives in the same order");
      abort(message);
      return failed_work(ctx, std::make_exception_ptr(PeerError(message)));
    }
  }
  return nullptr;
}

std::shared_ptr<Work> ProcessGroup::allreduce(at::Tensor& tensor,
                                              const AllreduceOptions& options) {
  check_tensor(*this, "allreduce", tensor);
  auto ctx = make_context("allreduce", options.timeout, &tensor);
  ctx.async_op = options.async_op;
  ctx.label.reduce_op = static_cast<int>(options.op);
  if (options.note != nullptr) {
    std::lock_guard<std::mutex> lock(recent_mutex_);
    if (Recorded* slot = recent_slot(ctx.sequence())) {
      std::strncpy(slot->note, options.note, kNoteBytes - 1);
      slot->note[kNoteBytes - 1] = '\0';
    }
  }
  if (options.check) {
    if (auto failed = check_same_collective(ctx)) {
      return completed_if_sync(ctx, record(ctx, failed));
    }
  }
  // Nothing to move: every rank has the same (empty) shape in a correct program.
  if (tensor.numel() == 0) return record(ctx, make_completed_work(ctx.label));
  HostStaging staging(!takes_cuda_tensors());
  at::Tensor& t = staging.tensor(tensor, true, true);
  return completed_if_sync(ctx, recorded(ctx, [&] {
    return staging.finish(run_allreduce(t, options.op, ctx));
  }));
}

std::shared_ptr<Work> ProcessGroup::broadcast(at::Tensor& tensor,
                                              const BroadcastOptions& options) {
  check_tensor(*this, "broadcast", tensor);
  check_rank(*this, "broadcast", options.root, "root");
  auto ctx = make_context("broadcast", options.timeout, &tensor);
  ctx.async_op = options.async_op;
  ctx.label.root = options.root;
  if (auto failed = check_same_collective(ctx)) {
    return completed_if_sync(ctx, record(ctx, failed));
  }
  // Nothing to move: every rank has the same (empty) shape in a correct program.
  if (tensor.numel() == 0) return record(ctx, make_completed_work(ctx.label));
  HostStaging staging(!takes_cuda_tensors());
  at::Tensor& t = staging.tensor(tensor, rank_ == options.root, rank_ != options.root);
  return completed_if_sync(ctx, recorded(ctx, [&] {
    return staging.finish(run_broadcast(t, options.root, ctx));
  }));
}

std::shared_ptr<Work> ProcessGroup::reduce(at::Tensor& tensor, const ReduceOptions& options) {
  check_tensor(*this, "reduce", tensor);
  check_rank(*this, "reduce", options.root, "root");
  auto ctx = make_context("reduce", options.timeout, &tensor);
  ctx.label.reduce_op = static_cast<int>(options.op);
  ctx.label.root = options.root;
  if (auto failed = check_same_collective(ctx)) return record(ctx, failed);
  // Nothing to move: every rank has the same (empty) shape in a correct program.
  if (tensor.numel() == 0) return record(ctx, make_completed_work(ctx.label));
  HostStaging staging(!takes_cuda_tensors());
  at::Tensor& t = staging.tensor(tensor, true, true);
  return recorded(ctx, [&] { return staging.finish(run_reduce(t, options.root, options.op, ctx)); });
}

std::shared_ptr<Work> ProcessGroup::allgather(std::vector<at::Tensor>& outputs,
                                              const at::Tensor& input,
                                              const AllgatherOptions& options) {
  check_tensor(*this, "allgather", input, "input");
  check_list(*this, "allgather", outputs, input, "outputs");
  auto ctx = make_context("allgather", options.timeout, &input);
  ctx.async_op = options.async_op;
  if (auto failed = check_same_collective(ctx)) {
    return completed_if_sync(ctx, record(ctx, failed));
  }
  // Nothing to move: every rank has the same (empty) shape in a correct program.
  if (input.numel() == 0) return record(ctx, make_completed_work(ctx.label));
  HostStaging staging(!takes_cuda_tensors());
  const at::Tensor& in = staging.input(input);
  auto& outs = staging.list(outputs, false, true);
  return completed_if_sync(ctx, recorded(ctx, [&] {
    return staging.finish(run_allgather(outs, in, ctx));
  }));
}

namespace {

// size() equal views of `flat` (contiguous, size() * block.numel() elements), each shaped like
// `block`: what the flat collectives hand to the list forms.
std::vector<at::Tensor> blocks_of(const ProcessGroup& pg, const char* op, const at::Tensor& flat,
                                  const at::Tensor& block, const char* flat_name,
                                  const char* block_name) {
  check_tensor(pg, op, flat, flat_name);
  check_tensor(pg, op, block, block_name);
  SHOAL_CHECK_T(InvalidArgument, flat.is_contiguous() && block.is_contiguous(), pg.rank_prefix(),
                " ", op, ": the ", flat_name, " and the ", block_name, " must be contiguous");
  SHOAL_CHECK_T(InvalidArgument,
                flat.numel() == block.numel() * pg.size() &&
                    flat.scalar_type() == block.scalar_type() && flat.device() == block.device(),
                pg.rank_prefix(), " ", op, ": the ", flat_name, " (", flat.numel(), " ",
                c10::toString(flat.scalar_type()), ") must hold world size (", pg.size(),
                ") times the ", block_name, "'s elements (", block.numel(), " ",
                c10::toString(block.scalar_type()), "), of the same dtype and device");
  const at::Tensor linear = flat.view({-1});
  std::vector<at::Tensor> blocks;
  blocks.reserve(static_cast<size_t>(pg.size()));
  for (int r = 0; r < pg.size(); ++r) {
    blocks.push_back(linear.narrow(0, r * block.numel(), block.numel()).view(block.sizes()));
  }
  return blocks;
}

}  // namespace

std::shared_ptr<Work> ProcessGroup::all_gather_into_tensor(at::Tensor& output,
                                                           const at::Tensor& input,
                                                           const AllgatherOptions& options) {
  std::vector<at::Tensor> outputs =
      blocks_of(*this, "all_gather_into_tensor", output, input, "output", "input");
  return allgather(outputs, input, options);
}

std::shared_ptr<Work> ProcessGroup::reduce_scatter_tensor(at::Tensor& output,
                                                          const at::Tensor& input,
                                                          const ReduceScatterOptions& options) {
  std::vector<at::Tensor> inputs =
      blocks_of(*this, "reduce_scatter_tensor", input, output, "input", "output");
  return reduce_scatter(output, inputs, options);
}

std::shared_ptr<Work> ProcessGroup::reduce_scatter(at::Tensor& output,
                                                   std::vector<at::Tensor>& inputs,
                                                   const ReduceScatterOptions& options) {
  check_tensor(*this, "reduce_scatter", output, "output");
  check_list(*this, "reduce_scatter", inputs, output, "inputs");
  auto ctx = make_context("reduce_scatter", options.timeout, &output);
  ctx.async_op = options.async_op;
  ctx.label.reduce_op = static_cast<int>(options.op);
  if (auto failed = check_same_collective(ctx)) {
    return completed_if_sync(ctx, record(ctx, failed));
  }
  // Nothing to move: every rank has the same (empty) shape in a correct program.
  if (output.numel() == 0) return record(ctx, make_completed_work(ctx.label));
  HostStaging staging(!takes_cuda_tensors());
  at::Tensor& out = staging.tensor(output, false, true);
  auto& ins = staging.list(inputs, true, false);
  return completed_if_sync(ctx, recorded(ctx, [&] {
    return staging.finish(run_reduce_scatter(out, ins, options.op, ctx));
  }));
}

std::shared_ptr<Work> ProcessGroup::gather(std::vector<at::Tensor>& outputs,
                                           const at::Tensor& input, const GatherOptions& options) {
  check_tensor(*this, "gather", input, "input");
  check_rank(*this, "gather", options.root, "root");
  if (rank_ == options.root) check_list(*this, "gather", outputs, input, "outputs");
  auto ctx = make_context("gather", options.timeout, &input);
  ctx.label.root = options.root;
  if (auto failed = check_same_collective(ctx)) return record(ctx, failed);
  // Nothing to move: every rank has the same (empty) shape in a correct program.
  if (input.numel() == 0) return record(ctx, make_completed_work(ctx.label));
  HostStaging staging(!takes_cuda_tensors());
  const at::Tensor& in = staging.input(input);
  auto& outs = staging.list(outputs, false, true);
  return recorded(ctx, [&] { return staging.finish(run_gather(outs, in, options.root, ctx)); });
}

std::shared_ptr<Work> ProcessGroup::scatter(at::Tensor& output, std::vector<at::Tensor>& inputs,
                                            const ScatterOptions& options) {
  check_tensor(*this, "scatter", output, "output");
  check_rank(*this, "scatter", options.root, "root");
  if (rank_ == options.root) check_list(*this, "scatter", inputs, output, "inputs");
  auto ctx = make_context("scatter", options.timeout, &output);
  ctx.label.root = options.root;
  if (auto failed = check_same_collective(ctx)) return record(ctx, failed);
  // Nothing to move: every rank has the same (empty) shape in a correct program.
  if (output.numel() == 0) return record(ctx, make_completed_work(ctx.label));
  HostStaging staging(!takes_cuda_tensors());
  at::Tensor& out = staging.tensor(output, false, true);
  auto& ins = staging.list(inputs, true, false);
  return recorded(ctx, [&] { return staging.finish(run_scatter(out, ins, options.root, ctx)); });
}

std::shared_ptr<Work> ProcessGroup::send(const at::Tensor& tensor, int dst,
                                         const SendRecvOptions& options) {
  check_tensor(*this, "send", tensor);
  check_rank(*this, "send", dst, "destination");
  SHOAL_CHECK_T(InvalidArgument, dst != rank_, rank_prefix(), " send: cannot send to itself");
  // Point-to-point operations are numbered too, but only the pair involved sees them, so their
  // numbers are not comparable across the group.
  auto ctx = make_context("send", options.timeout, &tensor);
  ctx.label.peer = dst;
  ctx.label.peer_role = OpLabel::PeerRole::kDestination;
  ctx.label.tag = options.tag;
  // Nothing to move: every rank has the same (empty) shape in a correct program.
  if (tensor.numel() == 0) return record(ctx, make_completed_work(ctx.label));
  HostStaging staging(!takes_cuda_tensors());
  const at::Tensor& t = staging.input(tensor);
  return recorded(ctx, [&] { return staging.finish(run_send(t, dst, options.tag, ctx)); });
}

std::shared_ptr<Work> ProcessGroup::recv(at::Tensor& tensor, int src,
                                         const SendRecvOptions& options) {
  check_tensor(*this, "recv", tensor);
  check_rank(*this, "recv", src, "source");
  SHOAL_CHECK_T(InvalidArgument, src != rank_, rank_prefix(), " recv: cannot receive from itself");
  auto ctx = make_context("recv", options.timeout, &tensor);
  ctx.label.peer = src;
  ctx.label.peer_role = OpLabel::PeerRole::kSource;
  ctx.label.tag = options.tag;
  // Nothing to move: every rank has the same (empty) shape in a correct program.
  if (tensor.numel() == 0) return record(ctx, make_completed_work(ctx.label));
  HostStaging staging(!takes_cuda_tensors());
  at::Tensor& t = staging.tensor(tensor, false, true);
  return recorded(ctx, [&] { return staging.finish(run_recv(t, src, options.tag, ctx)); });
}

std::shared_ptr<Work> ProcessGroup::barrier(const BarrierOptions& options) {
  auto ctx = make_context("barrier", options.timeout, nullptr);
  if (auto failed = check_same_collective(ctx)) return record(ctx, failed);
  return recorded(ctx, [&] { return run_barrier(ctx); });
}

at::Tensor ProcessGroup::empty_symmetric(int64_t numel, at::ScalarType dtype, Milliseconds timeout) {
  SHOAL_CHECK_T(InvalidArgument, numel >= 0, rank_prefix(), " empty_symmetric: numel is ", numel,
                "; it must be 0 or more");
  auto ctx = make_context("empty_symmetric", timeout, nullptr);
  ctx.label.numel = numel;
  ctx.label.dtype = dtype;
  at::Tensor tensor = run_empty_symmetric(numel, dtype, ctx);
  record(ctx, make_completed_work(ctx.label));
  return tensor;
}

at::Tensor ProcessGroup::run_empty_symmetric(int64_t numel, at::ScalarType dtype,
                                             const OpContext& ctx) {
  return torch::empty({numel}, torch::TensorOptions().dtype(dtype));
}

std::shared_ptr<ProcessGroup> ProcessGroup::new_group(const std::vector<int>& ranks) {
  SHOAL_CHECK_T(InvalidArgument, !ranks.empty(), rank_prefix(), " new_group: the rank list is empty");
  for (size_t i = 0; i < ranks.size(); ++i) {
    check_rank(*this, "new_group", ranks[i], "member");
    SHOAL_CHECK_T(InvalidArgument, i == 0 || ranks[i] > ranks[i - 1], rank_prefix(),
                  " new_group: ranks must be ascending and distinct");
  }
  const uint64_t group_id = ++groups_created_;
  auto it = std::find(ranks.begin(), ranks.end(), rank_);
  if (it == ranks.end()) return nullptr;
  auto group = run_new_group(ranks, static_cast<int>(it - ranks.begin()), group_id);
  if (hang_reporter_) {
    std::vector<int> job_ranks;
    for (int r : ranks) job_ranks.push_back(hang_reporter_->job_rank(r));
    group->enable_hang_reports(hang_reporter_->store(),
                               hang_reporter_->scope() + "/g" + std::to_string(group_id),
                               std::move(job_ranks));
  }
  // Every member must have finished connecting before any of them may use or drop the group.
  group->barrier()->wait();
  return group;
}

}  // namespace shoal::comm
