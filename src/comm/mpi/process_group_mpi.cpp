#include "comm/mpi/process_group_mpi.h"

#include <ATen/ATen.h>

#include <climits>
#include <cstring>

#include "comm/backends.h"
#include "comm/mpi/mpi_runtime.h"
#include "comm/timeouts.h"
#include "shoal/error.h"

namespace shoal::comm {
namespace {

// Tag of the failure notices on the control communicator (any value below MPI_TAG_UB works).
constexpr int kFailureTag = 7001;
// Extra time Work::wait gives the worker beyond the operation's own time-out and the diagnosis,
// so that the worker's precise error, not a generic one, reaches the caller.
constexpr Milliseconds kWaitMargin{1000};
// MPI_Test polls that only yield the CPU before the poller starts sleeping: about a millisecond
// of spinning covers a small collective on one host without a sleep's latency (~60 us).
constexpr int kSpinPolls = 1000;
// Longest sleep between polls. OpenMPI's non-blocking collectives progress only inside MPI_Test,
// so a long sleep would slow large operations down; 100 us keeps that under a few percent.
constexpr auto kMaxNap = std::chrono::microseconds(100);
// Collectives up to this size run on the calling thread when nothing is queued or running: the
// hand-off to the worker (a thread wake-up, 10-100 us on a loaded machine) would cost more than
// the operation (a few microseconds between ranks of one host).
constexpr int64_t kInlineBytes = 64 << 10;

using Clock = std::chrono::steady_clock;

MPI_Datatype mpi_type(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return MPI_FLOAT;
    case at::kDouble: return MPI_DOUBLE;
    case at::kInt: return MPI_INT32_T;
    case at::kLong: return MPI_INT64_T;
    case at::kByte: return MPI_UINT8_T;
    case at::kChar: return MPI_INT8_T;
    default: break;
  }
  SHOAL_THROW(InvalidArgument, "mpi: no MPI type for ", c10::toString(type));
}

MPI_Op mpi_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg: return MPI_SUM;
    case ReduceOp::kMin: return MPI_MIN;
    case ReduceOp::kMax: return MPI_MAX;
    case ReduceOp::kProduct: return MPI_PROD;
  }
  return MPI_SUM;
}

// MPI has no 16-bit float types: float16 and bfloat16 are reduced in a float32 copy.
at::Tensor reducible(const at::Tensor& tensor) {
  const auto type = tensor.scalar_type();
  return (type == at::kHalf || type == at::kBFloat16) ? tensor.to(at::kFloat) : tensor;
}

void divide_for_avg(at::Tensor& buffer, ReduceOp op, int n) {
  if (op != ReduceOp::kAvg) return;
  if (buffer.is_floating_point()) {
    buffer.div_(n);
  } else {
    buffer.floor_divide_(n);
  }
}

int count_of(int64_t n, const OpContext& ctx) {
  SHOAL_CHECK_T(InvalidArgument, n <= INT_MAX, ctx.prefix(),
                ": the mpi backend moves at most 2^31-1 elements or bytes in one call; split the "
                "tensor");
  return static_cast<int>(n);
}

int bytes_of(const at::Tensor& tensor, const OpContext& ctx) {
  return count_of(tensor.numel() * static_cast<int64_t>(tensor.element_size()), ctx);
}

void check_mpi(int rc, const std::string& prefix, const char* call) {
  if (rc != MPI_SUCCESS) {
    SHOAL_THROW(PeerError, prefix, " failed: ", call, ": ", mpi_error_string(rc));
  }
}

// The operation's prefix is built only when the call failed.
void check_mpi(int rc, const OpContext& ctx, const char* call) {
  if (rc != MPI_SUCCESS) check_mpi(rc, ctx.prefix(), call);
}

int comm_rank(MPI_Comm comm) {
  int rank = 0;
  MPI_Comm_rank(comm, &rank);
  return rank;
}

int comm_size(MPI_Comm comm) {
  int size = 1;
  MPI_Comm_size(comm, &size);
  return size;
}

// Duplicates `comm` without blocking past `timeout` (MPI_Comm_dup could wait forever).
MPI_Comm duplicate(MPI_Comm comm, Milliseconds timeout, const std::string& prefix) {
  MPI_Comm copy = MPI_COMM_NULL;
  std::vector<MPI_Request> request(1);
  {
    auto lock = MpiRuntime::get().lock();
    check_mpi(MPI_Comm_idup(comm, &copy, request.data()), prefix, "MPI_Comm_idup");
  }
  if (!ProcessGroupMpi::poll(request, Clock::now() + timeout)) {
    MpiRuntime::get().note_abandoned_request();
    SHOAL_THROW(TimeoutError, prefix, ": not every rank created the group within ",
                timeout.count(), " ms (are all of them started, and do they all call it?)");
  }
  MPI_Comm_set_errhandler(copy, MPI_ERRORS_RETURN);
  return copy;
}

// A point-to-point operation, started on the caller's thread and polled by wait().
class MpiRequestWork : public Work {
 public:
  MpiRequestWork(const OpContext& ctx, MPI_Request request, at::Tensor buffer, int peer,
                 std::shared_ptr<ProcessGroupMpi> group)
      : Work(ctx.label),
        timeout_(ctx.timeout),
        requests_{request},
        buffer_(std::move(buffer)),
        peer_(peer),
        group_(std::move(group)) {}

  bool is_completed() override {
    std::lock_guard<std::mutex> guard(mutex_);
    if (done_) return true;
    int flag = 0;
    auto lock = MpiRuntime::get().lock();
    MPI_Testall(1, requests_.data(), &flag, MPI_STATUSES_IGNORE);
    return flag != 0;
  }

  void wait(Milliseconds timeout) override {
    std::lock_guard<std::mutex> guard(mutex_);
    if (!done_) {
      if (timeout == kGroupTimeout) timeout = timeout_;
      bool ok = false;
      try {
        ok = ProcessGroupMpi::poll(requests_, Clock::now() + timeout);
      } catch (const std::exception& e) {
        record(PeerError(detail::str_cat(label().prefix(), " failed: ", e.what())));
      }
      if (!done_ && !ok) {
        const std::string reason = group_->abort_reason();
        if (!reason.empty()) {
          record(PeerError(
              detail::str_cat(label().prefix(), " failed: the group was aborted: ", reason)));
        } else {
          record(TimeoutError(detail::str_cat(label().prefix(), " timed out after ",
                                              timeout.count(), " ms waiting for rank ", peer_, kTimeoutHint)));
        }
        group_->abandon(requests_, {buffer_});
        group_->abort(detail::str_cat(label().prefix(), " did not complete"));
      }
      done_ = true;
    }
    if (error_) std::rethrow_exception(error_);
  }

  std::exception_ptr exception() override {
    std::lock_guard<std::mutex> guard(mutex_);
    return error_;
  }

 private:
  template <typename E>
  void record(const E& error) {
    if (!error_) error_ = std::make_exception_ptr(error);
  }

  std::mutex mutex_;
  Milliseconds timeout_;
  std::vector<MPI_Request> requests_;
  at::Tensor buffer_;
  int peer_;
  std::shared_ptr<ProcessGroupMpi> group_;
  bool done_ = false;
  std::exception_ptr error_;
};

}  // namespace

std::shared_ptr<ProcessGroupMpi> ProcessGroupMpi::create_world(Milliseconds timeout) {
  MpiRuntime::get();
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  const std::string prefix = detail::str_cat("[rank ", comm_rank(MPI_COMM_WORLD), "/",
                                             comm_size(MPI_COMM_WORLD), "] mpi");
  return std::make_shared<ProcessGroupMpi>(duplicate(MPI_COMM_WORLD, timeout, prefix), timeout);
}

ProcessGroupMpi::ProcessGroupMpi(MPI_Comm comm, Milliseconds timeout)
    : ProcessGroup(comm_rank(comm), comm_size(comm), timeout), comm_(comm) {
  MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
  control_ = duplicate(comm_, timeout, rank_prefix() + " mpi");
  worker_ = std::thread([this] { run_worker(); });
}

ProcessGroupMpi::~ProcessGroupMpi() {
  {
    std::lock_guard<std::mutex> guard(mutex_);
    stop_ = true;
  }
  queue_cv_.notify_all();
  if (worker_.joinable()) {
    // A worker stuck in a blocking MPI call (communicator creation with a dead peer) never
    // returns; it is left behind rather than hanging the caller.
    if (in_blocking_call_) {
      worker_.detach();
    } else {
      worker_.join();
    }
  }
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized && !aborted_) {
    auto lock = MpiRuntime::get().lock();
    MPI_Comm_free(&control_);
    MPI_Comm_free(&comm_);
  }
}

bool ProcessGroupMpi::poll(std::vector<MPI_Request>& requests, Clock::time_point deadline) {
  auto& runtime = MpiRuntime::get();
  auto nap = std::chrono::microseconds(5);
  for (int polls = 0;; ++polls) {
    int flag = 0;
    int rc;
    {
      auto lock = runtime.lock();
      rc = MPI_Testall(static_cast<int>(requests.size()), requests.data(), &flag,
                       MPI_STATUSES_IGNORE);
    }
    if (rc != MPI_SUCCESS) SHOAL_THROW(PeerError, "MPI_Testall: ", mpi_error_string(rc));
    if (flag) return true;
    if (Clock::now() >= deadline) return false;
    if (polls < kSpinPolls) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(nap);
      nap = std::min(nap * 2, std::chrono::duration_cast<std::chrono::microseconds>(kMaxNap));
    }
  }
}

std::string ProcessGroupMpi::diagnose(uint64_t sequence, Milliseconds budget) {
  auto& runtime = MpiRuntime::get();
  std::vector<bool> reported(size(), false);
  reported[rank()] = true;
  {
    std::lock_guard<std::mutex> guard(mutex_);
    notices_.push_back(std::make_unique<uint64_t>(sequence));
    uint64_t* payload = notices_.back().get();
    auto lock = runtime.lock();
    for (int peer = 0; peer < size(); ++peer) {
      if (peer == rank()) continue;
      MPI_Request request;
      if (MPI_Isend(payload, 1, MPI_UINT64_T, peer, kFailureTag, control_, &request) ==
          MPI_SUCCESS) {
        // Never waited on: a dead or stuck peer never receives it; the payload lives on.
        MPI_Request_free(&request);
      }
    }
  }
  const auto deadline = Clock::now() + budget;
  int missing = size() - 1;
  while (missing > 0 && Clock::now() < deadline) {
    int flag = 0;
    MPI_Status status;
    {
      auto lock = runtime.lock();
      MPI_Iprobe(MPI_ANY_SOURCE, kFailureTag, control_, &flag, &status);
      if (flag) {
        uint64_t theirs = 0;
        MPI_Recv(&theirs, 1, MPI_UINT64_T, status.MPI_SOURCE, kFailureTag, control_,
                 MPI_STATUS_IGNORE);
        if (!reported[status.MPI_SOURCE]) {
          reported[status.MPI_SOURCE] = true;
          --missing;
        }
      }
    }
    if (!flag) std::this_thread::sleep_for(Milliseconds(1));
  }
  std::string out;
  for (int r = 0; r < size(); ++r) {
    if (!reported[r]) {
      out += detail::str_cat(out.empty() ? "" : ", ", "rank ", r,
                             " (did not reach this operation: stuck, slow or dead)");
    }
  }
  return out;
}

void ProcessGroupMpi::abandon(std::vector<MPI_Request> requests, std::vector<at::Tensor> buffers) {
  MpiRuntime::get().note_abandoned_request();
  std::lock_guard<std::mutex> guard(mutex_);
  for (auto r : requests) {
    if (r != MPI_REQUEST_NULL) abandoned_requests_.push_back(r);
  }
  for (auto& b : buffers) abandoned_buffers_.push_back(std::move(b));
}

std::string ProcessGroupMpi::abort_reason() {
  std::lock_guard<std::mutex> guard(mutex_);
  return abort_reason_;
}

void ProcessGroupMpi::abort(const std::string& reason) {
  std::deque<Task> dropped;
  {
    std::lock_guard<std::mutex> guard(mutex_);
    if (aborted_) return;
    aborted_ = true;
    abort_reason_ = reason;
    dropped.swap(queue_);
  }
  for (auto& task : dropped) {
    task.work->finish_with_error(std::make_exception_ptr(PeerError(detail::str_cat(
        task.ctx.prefix(), " was not run: the group was aborted: ", reason))));
  }
}

std::shared_ptr<Work> ProcessGroupMpi::failed_work(const OpContext& ctx) {
  auto work = std::make_shared<PromiseWork>(ctx.label, ctx.timeout);
  work->finish_with_error(std::make_exception_ptr(PeerError(
      detail::str_cat(ctx.prefix(), " was not run: the group was aborted: ", abort_reason()))));
  return work;
}

std::shared_ptr<Work> ProcessGroupMpi::enqueue(const OpContext& ctx,
                                               std::function<Started()> start) {
  auto work = std::make_shared<PromiseWork>(
      ctx.label, ctx.timeout + std::min(kDiagnoseBudget, ctx.timeout / 2) + kWaitMargin);
  const OpLabel& label = ctx.label;
  const bool small =
      std::strcmp(ctx.name(), "barrier") == 0 ||
      (label.numel >= 0 && label.numel * static_cast<int64_t>(c10::elementSize(label.dtype)) <=
                               kInlineBytes);
  std::unique_lock<std::mutex> guard(mutex_);
  if (aborted_ || stop_) {
    guard.unlock();
    return failed_work(ctx);
  }
  if (small && queue_.empty() && !running_) {
    // In order: nothing before it is queued or running, and the worker waits while it runs.
    running_ = true;
    guard.unlock();
    Task task{ctx, std::move(start), work};
    execute(task);
    guard.lock();
    running_ = false;
    if (!queue_.empty()) queue_cv_.notify_one();
    return work;
  }
  queue_.push_back(Task{ctx, std::move(start), work});
  queue_cv_.notify_one();
  return work;
}

void ProcessGroupMpi::run_worker() {
  while (true) {
    Task task;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      queue_cv_.wait(lock, [&] { return !running_ && (stop_ || !queue_.empty()); });
      if (queue_.empty()) return;
      task = std::move(queue_.front());
      queue_.pop_front();
      running_ = true;
    }
    execute(task);
    std::lock_guard<std::mutex> lock(mutex_);
    running_ = false;
  }
}

void ProcessGroupMpi::execute(Task& task) {
  const OpContext& ctx = task.ctx;
  if (aborted_) {
    task.work->finish_with_error(std::make_exception_ptr(PeerError(detail::str_cat(
        ctx.prefix(), " was not run: the group was aborted: ", abort_reason()))));
    return;
  }
  try {
    const auto deadline = Clock::now() + ctx.timeout;
    Started started;
    {
      auto lock = MpiRuntime::get().lock();
      started = task.start();
    }
    if (!poll(started.requests, deadline)) {
      const std::string who =
          diagnose(ctx.sequence(), std::min(kDiagnoseBudget, ctx.timeout / 2));
      abandon(started.requests, started.buffers);
      SHOAL_THROW(TimeoutError, ctx.prefix(), " timed out after ", ctx.timeout.count(),
                  " ms waiting for ",
                  who.empty() ? "ranks that had already given up on it (every other rank "
                                "reported a failure of this operation)"
                              : who,
                  kTimeoutHint, hang_report());
    }
    if (started.finish) started.finish();
    task.work->finish();
  } catch (const shoal::Error& e) {
    task.work->finish_with_error(std::current_exception());
    if (!dynamic_cast<const InvalidArgument*>(&e)) abort(e.what());
  } catch (const std::exception& e) {
    task.work->finish_with_error(std::make_exception_ptr(
        PeerError(detail::str_cat(ctx.prefix(), " failed: ", e.what()))));
    abort(e.what());
  }
}

std::shared_ptr<Work> ProcessGroupMpi::run_allreduce(at::Tensor& tensor, ReduceOp op,
                                                     const OpContext& ctx) {
  at::Tensor buffer = reducible(tensor);
  const int count = count_of(buffer.numel(), ctx);
  const MPI_Datatype type = mpi_type(buffer.scalar_type());
  const int n = size();
  return enqueue(ctx, [=]() mutable {
    Started s;
    s.requests.resize(1);
    check_mpi(MPI_Iallreduce(MPI_IN_PLACE, buffer.data_ptr(), count, type, mpi_op(op), comm_,
                             s.requests.data()),
              ctx, "MPI_Iallreduce");
    s.buffers = {buffer};
    s.finish = [=]() mutable {
      divide_for_avg(buffer, op, n);
      if (!buffer.is_same(tensor)) tensor.copy_(buffer);
    };
    return s;
  });
}

std::shared_ptr<Work> ProcessGroupMpi::run_broadcast(at::Tensor& tensor, int root,
                                                     const OpContext& ctx) {
  const int bytes = bytes_of(tensor, ctx);
  at::Tensor buffer = tensor;
  return enqueue(ctx, [=]() mutable {
    Started s;
    s.requests.resize(1);
    check_mpi(MPI_Ibcast(buffer.data_ptr(), bytes, MPI_BYTE, root, comm_, s.requests.data()),
              ctx, "MPI_Ibcast");
    s.buffers = {buffer};
    return s;
  });
}

std::shared_ptr<Work> ProcessGroupMpi::run_reduce(at::Tensor& tensor, int root, ReduceOp op,
                                                  const OpContext& ctx) {
  at::Tensor buffer = reducible(tensor);
  const int count = count_of(buffer.numel(), ctx);
  const MPI_Datatype type = mpi_type(buffer.scalar_type());
  const int n = size();
  const bool is_root = rank() == root;
  return enqueue(ctx, [=]() mutable {
    Started s;
    s.requests.resize(1);
    check_mpi(MPI_Ireduce(is_root ? MPI_IN_PLACE : buffer.data_ptr(),
                          is_root ? buffer.data_ptr() : nullptr, count, type, mpi_op(op), root,
                          comm_, s.requests.data()),
              ctx, "MPI_Ireduce");
    s.buffers = {buffer};
    s.finish = [=]() mutable {
      if (!is_root) return;
      divide_for_avg(buffer, op, n);
      if (!buffer.is_same(tensor)) tensor.copy_(buffer);
    };
    return s;
  });
}

std::shared_ptr<Work> ProcessGroupMpi::run_allgather(std::vector<at::Tensor>& outputs,
                                                     const at::Tensor& input,
                                                     const OpContext& ctx) {
  const int bytes = bytes_of(input, ctx);
  count_of(static_cast<int64_t>(bytes) * size(), ctx);
  at::Tensor in = input;
  at::Tensor flat = at::empty({size(), input.numel()}, input.options());
  std::vector<at::Tensor> outs = outputs;
  return enqueue(ctx, [=]() mutable {
    Started s;
    s.requests.resize(1);
    check_mpi(MPI_Iallgather(in.data_ptr(), bytes, MPI_BYTE, flat.data_ptr(), bytes, MPI_BYTE,
                             comm_, s.requests.data()),
              ctx, "MPI_Iallgather");
    s.buffers = {in, flat};
    s.finish = [=]() mutable {
      for (size_t i = 0; i < outs.size(); ++i) outs[i].copy_(flat[i].view(outs[i].sizes()));
    };
    return s;
  });
}

std::shared_ptr<Work> ProcessGroupMpi::run_reduce_scatter(at::Tensor& output,
                                                          std::vector<at::Tensor>& inputs,
                                                          ReduceOp op, const OpContext& ctx) {
  std::vector<at::Tensor> flat_inputs;
  for (const auto& input : inputs) flat_inputs.push_back(input.reshape({-1}));
  at::Tensor send = reducible(at::cat(flat_inputs));
  at::Tensor recv = send.scalar_type() == output.scalar_type()
                        ? output
                        : at::empty({output.numel()}, send.options());
  const int count = count_of(output.numel(), ctx);
  count_of(send.numel(), ctx);
  const MPI_Datatype type = mpi_type(send.scalar_type());
  const int n = size();
  at::Tensor out = output;
  return enqueue(ctx, [=]() mutable {
    Started s;
    s.requests.resize(1);
    check_mpi(MPI_Ireduce_scatter_block(send.data_ptr(), recv.data_ptr(), count, type, mpi_op(op),
                                        comm_, s.requests.data()),
              ctx, "MPI_Ireduce_scatter_block");
    s.buffers = {send, recv};
    s.finish = [=]() mutable {
      divide_for_avg(recv, op, n);
      if (!recv.is_same(out)) out.copy_(recv.view(out.sizes()));
    };
    return s;
  });
}

std::shared_ptr<Work> ProcessGroupMpi::run_gather(std::vector<at::Tensor>& outputs,
                                                  const at::Tensor& input, int root,
                                                  const OpContext& ctx) {
  const int bytes = bytes_of(input, ctx);
  const bool is_root = rank() == root;
  at::Tensor in = input;
  at::Tensor flat = is_root ? at::empty({size(), input.numel()}, input.options()) : at::Tensor();
  std::vector<at::Tensor> outs = is_root ? outputs : std::vector<at::Tensor>();
  return enqueue(ctx, [=]() mutable {
    Started s;
    s.requests.resize(1);
    check_mpi(MPI_Igather(in.data_ptr(), bytes, MPI_BYTE, is_root ? flat.data_ptr() : nullptr,
                          bytes, MPI_BYTE, root, comm_, s.requests.data()),
              ctx, "MPI_Igather");
    s.buffers = {in};
    if (is_root) s.buffers.push_back(flat);
    s.finish = [=]() mutable {
      for (size_t i = 0; i < outs.size(); ++i) outs[i].copy_(flat[i].view(outs[i].sizes()));
    };
    return s;
  });
}

std::shared_ptr<Work> ProcessGroupMpi::run_scatter(at::Tensor& output,
                                                   std::vector<at::Tensor>& inputs, int root,
                                                   const OpContext& ctx) {
  const int bytes = bytes_of(output, ctx);
  const bool is_root = rank() == root;
  at::Tensor flat;
  if (is_root) {
    std::vector<at::Tensor> flat_inputs;
    for (const auto& input : inputs) flat_inputs.push_back(input.reshape({-1}));
    flat = at::cat(flat_inputs);
  }
  at::Tensor out = output;
  return enqueue(ctx, [=]() mutable {
    Started s;
    s.requests.resize(1);
    check_mpi(MPI_Iscatter(is_root ? flat.data_ptr() : nullptr, bytes, MPI_BYTE, out.data_ptr(),
                           bytes, MPI_BYTE, root, comm_, s.requests.data()),
              ctx, "MPI_Iscatter");
    s.buffers = {out};
    if (is_root) s.buffers.push_back(flat);
    return s;
  });
}

std::shared_ptr<Work> ProcessGroupMpi::run_send(const at::Tensor& tensor, int dst, int tag,
                                                const OpContext& ctx) {
  if (aborted_) return failed_work(ctx);
  MPI_Request request;
  {
    auto lock = MpiRuntime::get().lock();
    check_mpi(MPI_Isend(tensor.data_ptr(), bytes_of(tensor, ctx), MPI_BYTE, dst, tag, comm_,
                        &request),
              ctx, "MPI_Isend");
  }
  return std::make_shared<MpiRequestWork>(
      ctx, request, tensor, dst, std::static_pointer_cast<ProcessGroupMpi>(shared_from_this()));
}

std::shared_ptr<Work> ProcessGroupMpi::run_recv(at::Tensor& tensor, int src, int tag,
                                                const OpContext& ctx) {
  if (aborted_) return failed_work(ctx);
  MPI_Request request;
  {
    auto lock = MpiRuntime::get().lock();
    check_mpi(MPI_Irecv(tensor.data_ptr(), bytes_of(tensor, ctx), MPI_BYTE, src, tag, comm_,
                        &request),
              ctx, "MPI_Irecv");
  }
  return std::make_shared<MpiRequestWork>(
      ctx, request, tensor, src, std::static_pointer_cast<ProcessGroupMpi>(shared_from_this()));
}

std::shared_ptr<Work> ProcessGroupMpi::run_barrier(const OpContext& ctx) {
  return enqueue(ctx, [=]() {
    Started s;
    s.requests.resize(1);
    check_mpi(MPI_Ibarrier(comm_, s.requests.data()), ctx, "MPI_Ibarrier");
    return s;
  });
}

std::shared_ptr<ProcessGroup> ProcessGroupMpi::run_new_group(const std::vector<int>& ranks,
                                                             int group_rank, uint64_t group_id) {
  OpContext ctx;
  ctx.timeout = timeout();
  ctx.label.name = "new_group";
  ctx.label.sequence = sequence_number();
  ctx.label.rank = rank();
  ctx.label.size = size();
  ctx.label.detail = detail::str_cat("group ", group_id, ", ", ranks.size(), " ranks");
  auto created = std::make_shared<MPI_Comm>(MPI_COMM_NULL);
  // MPI_Comm_create_group involves only the members (the others do not call new_group's
  // run_new_group) but has no non-blocking form: it runs on the worker, in order with the
  // collectives, and the caller's wait below bounds it.
  auto work = enqueue(ctx, [=]() {
    MPI_Group all, members;
    MPI_Comm_group(comm_, &all);
    MPI_Group_incl(all, static_cast<int>(ranks.size()), ranks.data(), &members);
    in_blocking_call_ = true;
    // Tags only need to differ between groups created concurrently from this communicator.
    const int rc = MPI_Comm_create_group(comm_, members, static_cast<int>(group_id % 30000),
                                         created.get());
    in_blocking_call_ = false;
    MPI_Group_free(&members);
    MPI_Group_free(&all);
    check_mpi(rc, ctx, "MPI_Comm_create_group");
    return Started{};
  });
  work->wait();
  (void)group_rank;
  return std::make_shared<ProcessGroupMpi>(*created, timeout());
}

std::shared_ptr<ProcessGroup> create_mpi_backend(const BackendArgs& args) {
  auto group = ProcessGroupMpi::create_world(args.timeout);
  SHOAL_CHECK_T(InvalidArgument,
                args.info.source == "default" ||
                    (group->rank() == args.rank && group->size() == args.size),
                group->rank_prefix(), " mpi: MPI_COMM_WORLD has this process as rank ",
                group->rank(), " of ", group->size(), " but it was configured as rank ", args.rank,
                " of ", args.size, " (from ", args.info.source,
                "); start it with mpirun -np ", args.size, ", or choose another backend");
  return group;
}

}  // namespace shoal::comm
