// ProcessGroup: the collective and point-to-point operations every backend provides.
//
// Shoal's own interface (no c10d type appears here), the counterpart of torch.distributed's
// ProcessGroup. Every call is asynchronous and returns a Work; every call has a finite time-out.
// The public methods check their arguments, number the operation (sequence numbers are per group
// and equal on every rank for the same collective) and hand it to the backend's run_* method, so
// each backend sees only valid, contiguous, dense tensors.
//
// Collectives must be issued in the same order on every rank of the group (as with
// torch.distributed). Thread safety: one thread issues a group's operations at a time; Work
// handles may be waited on from any thread.
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <array>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "shoal/comm/types.h"
#include "shoal/comm/work.h"

namespace shoal::comm {

class HangReporter;
class Store;

struct AllreduceOptions {
  ReduceOp op = ReduceOp::kSum;
  Milliseconds timeout = kGroupTimeout;
  /// false: skip the collective check (check_collectives()) for this call, for callers whose
  /// collectives are identical on every rank by construction (DDP's buckets, verified once when
  /// DDP is built). Every rank must pass the same value.
  bool check = true;
  /// Shown beside this operation in hang reports and recent_operations() (DDP: "bucket 3:
  /// fc2.weight, fc2.bias"); its first kNoteBytes - 1 characters are copied, nothing allocated.
  const char* note = nullptr;
  /// false: as torch.distributed's async_op=False, the call returns once the operation has
  /// completed (the Work it returns is done) and throws the operation's error itself. A backend
  /// that runs operations on a worker thread (shm) then runs it on the calling thread when
  /// nothing is queued before it, saving the hand-off (tens of microseconds on a busy machine).
  /// true (the default): the call returns at once; wait() on the Work.
  bool async_op = true;
};

struct BroadcastOptions {
  int root = 0;
  Milliseconds timeout = kGroupTimeout;
  /// false: the call returns once the operation has completed (AllreduceOptions::async_op).
  bool async_op = true;
};

struct ReduceOptions {
  int root = 0;
  ReduceOp op = ReduceOp::kSum;
  Milliseconds timeout = kGroupTimeout;
};

struct AllgatherOptions {
  Milliseconds timeout = kGroupTimeout;
  /// false: the call returns once the operation has completed (AllreduceOptions::async_op).
  bool async_op = true;
};

struct ReduceScatterOptions {
  ReduceOp op = ReduceOp::kSum;
  Milliseconds timeout = kGroupTimeout;
  /// false: the call returns once the operation has completed (AllreduceOptions::async_op).
  bool async_op = true;
};

struct GatherOptions {
  int root = 0;
  Milliseconds timeout = kGroupTimeout;
};

struct ScatterOptions {
  int root = 0;
  Milliseconds timeout = kGroupTimeout;
};

struct SendRecvOptions {
  int tag = 0;
  Milliseconds timeout = kGroupTimeout;
};

struct BarrierOptions {
  Milliseconds timeout = kGroupTimeout;
};

/// What a backend is told about each operation, for its own bookkeeping and error messages.
struct OpContext {
  Milliseconds timeout{0};    ///< resolved time-out (never kGroupTimeout)
  OpLabel label;              ///< what the operation is: name, sequence number, sizes...
  bool async_op = true;       ///< false: the caller waits for it at once (see AllreduceOptions)

  /// "allreduce", "broadcast", ...
  const char* name() const { return label.name; }
  /// Per-group sequence number, equal on every rank.
  uint64_t sequence() const { return label.sequence; }

  /// "allreduce #12 (4.0 MB float32, sum)": built on each call, for messages only.
  std::string description() const { return label.description(); }
  /// "[rank 1/4] allreduce #12 (4.0 MB float32, sum)": built on each call, for messages only.
  std::string prefix() const { return label.prefix(); }
};

/// SHOAL_DEBUG=detail (PyTorch's TORCH_DISTRIBUTED_DEBUG=DETAIL): the checks that find a rank
/// that diverged (mismatched collectives, gradients unused on some ranks), at a cost in speed.
bool debug_detail_from_env();

class ProcessGroup : public std::enable_shared_from_this<ProcessGroup> {
 public:
  virtual ~ProcessGroup();
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  /// The group's default time-out for every operation.
  Milliseconds timeout() const { return timeout_; }
  /// "gloo", "shm", "mpi", "nccl", "hierarchical".
  virtual std::string backend_name() const = 0;
  /// Number of operations issued so far (the last sequence number).
  uint64_t sequence_number() const { return sequence_.load(); }

  /// Reduces `tensor` across ranks in place; every rank gets the result.
  std::shared_ptr<Work> allreduce(at::Tensor& tensor, const AllreduceOptions& options = {});
  /// Copies root's `tensor` into every other rank's `tensor`.
  std::shared_ptr<Work> broadcast(at::Tensor& tensor, const BroadcastOptions& options = {});
  /// Reduces into root's `tensor`; other ranks' tensors are left in an unspecified state.
  std::shared_ptr<Work> reduce(at::Tensor& tensor, const ReduceOptions& options = {});
  /// outputs[i] receives rank i's `input`; `outputs` holds size() tensors shaped like `input`.
  std::shared_ptr<Work> allgather(std::vector<at::Tensor>& outputs, const at::Tensor& input,
                                  const AllgatherOptions& options = {});
  /// Reduces inputs[i] across ranks into rank i's `output`.
  std::shared_ptr<Work> reduce_scatter(at::Tensor& output, std::vector<at::Tensor>& inputs,
                                       const ReduceScatterOptions& options = {});
  /// PyTorch's all_gather_into_tensor: `output` (contiguous, size() times `input`'s elements, same
  /// dtype) receives every rank's `input` one after the other, rank 0's first. The list form over
  /// views into `output`: no staging copy where the backend writes the list in place (shm).
  std::shared_ptr<Work> all_gather_into_tensor(at::Tensor& output, const at::Tensor& input,
                                               const AllgatherOptions& options = {});
  /// PyTorch's reduce_scatter_tensor: `input` (contiguous, size() times `output`'s elements) is
  /// cut into size() equal blocks; block i, reduced across ranks, lands in rank i's `output`.
  std::shared_ptr<Work> reduce_scatter_tensor(at::Tensor& output, const at::Tensor& input,
                                              const ReduceScatterOptions& options = {});
  /// At root, outputs[i] receives rank i's `input`; `outputs` is ignored (may be empty) elsewhere.
  std::shared_ptr<Work> gather(std::vector<at::Tensor>& outputs, const at::Tensor& input,
                               const GatherOptions& options = {});
  /// Rank i's `output` receives root's inputs[i]; `inputs` is ignored (may be empty) elsewhere.
  std::shared_ptr<Work> scatter(at::Tensor& output, std::vector<at::Tensor>& inputs,
                                const ScatterOptions& options = {});
  /// Sends `tensor` to rank `dst`; matched by a recv with the same tag on `dst`.
  std::shared_ptr<Work> send(const at::Tensor& tensor, int dst, const SendRecvOptions& options = {});
  /// Receives into `tensor` from rank `src`.
  std::shared_ptr<Work> recv(at::Tensor& tensor, int src, const SendRecvOptions& options = {});
  /// Returns once every rank has entered the barrier.
  std::shared_ptr<Work> barrier(const BarrierOptions& options = {});

  /// An uninitialised 1-D tensor of `numel` elements of `dtype` in memory that every rank of the
  /// group maps (what PyTorch calls symmetric memory): collectives on it can read and write the
  /// peers' copies in place instead of staging them. On the shm backend, an allreduce of such a
  /// tensor touches half the bytes of an ordinary one and synchronises twice in all instead of
  /// twice per chunk. A collective call: every rank calls it with the same arguments, in the same
  /// order as the group's other collectives, and passes the same (whole) tensor to the collectives
  /// that use it. Backends without such memory, and shm when /dev/shm has no room, return an
  /// ordinary CPU tensor (is_symmetric() says which). The memory lives as long as the tensor.
  at::Tensor empty_symmetric(int64_t numel, at::ScalarType dtype,
                             Milliseconds timeout = kGroupTimeout);
  /// Whether `tensor` lies in memory from this group's empty_symmetric().
  virtual bool is_symmetric(const at::Tensor& tensor) const { return false; }

  /// Whether the backend works on CUDA tensors itself (nccl, or a multi-device group with a CUDA
  /// backend). The others work on host memory: their public methods copy CUDA tensors into pinned
  /// host memory and the results back once the operation completes (as PyTorch's gloo does), so
  /// every backend takes CUDA tensors; NCCL avoids the copies.
  virtual bool takes_cuda_tensors() const { return false; }

  /// A group over `ranks` (ranks of this group, ascending). Every rank of this group must call it
  /// with the same list, in the same order as other collectives; ranks not in the list get null.
  std::shared_ptr<ProcessGroup> new_group(const std::vector<int>& ranks);

  /// Makes every pending and later operation fail at once with `reason` (after a peer died).
  virtual void abort(const std::string& reason) {}

  /// Whether each collective first checks that every rank issues the same one (operation, element
  /// count, dtype, root, reduce op), so that a mismatch fails with a clear PeerError on every rank
  /// instead of garbage, a hang or (in Gloo and MPI) an abort. Off unless SHOAL_DEBUG=detail, as
  /// PyTorch checks only under TORCH_DISTRIBUTED_DEBUG=DETAIL: the check is one small allgather
  /// waited for before the collective starts, a round trip that below ~1 MiB costs as much as the
  /// collective itself. SHOAL_CHECK_COLLECTIVES=0 or 1 overrides SHOAL_DEBUG for this check alone.
  /// Every rank must use the same setting.
  bool check_collectives() const { return check_collectives_; }
  void set_check_collectives(bool on) { check_collectives_ = on; }

  /// "[rank 1/4]".
  std::string rank_prefix() const;

  /// This group's last operations (at most kRecentOperations), oldest first, each as
  /// "allreduce #12 (4.0 MB float32, sum): in flight for 3.2 s", "...: done" or "...: released"
  /// (its Work is gone): what a hung job
  /// was doing (SIGUSR1 prints it for every group, see flight_recorder.h).
  std::vector<std::string> recent_operations() const;
  static constexpr size_t kRecentOperations = 16;
  /// Room for an operation's note (AllreduceOptions::note), including its terminating zero.
  static constexpr size_t kNoteBytes = 64;

  /// From now on, when an operation of this group times out, its error names every rank's last
  /// started and last completed operation, gathered through `store` (keys under `scope`), so one
  /// message shows who is behind and where. init_process_group's groups and their new_group()s
  /// have it; off the failure path it costs one small store request per process (not per group)
  /// every second (on a thread of its own), nothing per operation. `job_ranks[r]`: the job rank
  /// of this group's rank r, whose heartbeat it shares; empty: r (a job's world group).
  void enable_hang_reports(std::shared_ptr<Store> store, const std::string& scope,
                           std::vector<int> job_ranks = {});

 protected:
  ProcessGroup(int rank, int size, Milliseconds timeout);

  virtual std::shared_ptr<Work> run_allreduce(at::Tensor& tensor, ReduceOp op,
                                              const OpContext& ctx) = 0;
  virtual std::shared_ptr<Work> run_broadcast(at::Tensor& tensor, int root,
                                              const OpContext& ctx) = 0;
  virtual std::shared_ptr<Work> run_reduce(at::Tensor& tensor, int root, ReduceOp op,
                                           const OpContext& ctx) = 0;
  virtual std::shared_ptr<Work> run_allgather(std::vector<at::Tensor>& outputs,
                                              const at::Tensor& input, const OpContext& ctx) = 0;
  virtual std::shared_ptr<Work> run_reduce_scatter(at::Tensor& output,
                                                   std::vector<at::Tensor>& inputs, ReduceOp op,
                                                   const OpContext& ctx) = 0;
  virtual std::shared_ptr<Work> run_gather(std::vector<at::Tensor>& outputs,
                                           const at::Tensor& input, int root,
                                           const OpContext& ctx) = 0;
  virtual std::shared_ptr<Work> run_scatter(at::Tensor& output, std::vector<at::Tensor>& inputs,
                                            int root, const OpContext& ctx) = 0;
  virtual std::shared_ptr<Work> run_send(const at::Tensor& tensor, int dst, int tag,
                                         const OpContext& ctx) = 0;
  virtual std::shared_ptr<Work> run_recv(at::Tensor& tensor, int src, int tag,
                                         const OpContext& ctx) = 0;
  virtual std::shared_ptr<Work> run_barrier(const OpContext& ctx) = 0;
  /// Allocates for empty_symmetric() (a collective; numel and dtype are validated). The default:
  /// an ordinary tensor.
  virtual at::Tensor run_empty_symmetric(int64_t numel, at::ScalarType dtype, const OpContext& ctx);
  /// Builds the sub-group; `ranks` is validated, and this rank is in it (`group_rank` its rank there).
  /// `group_id` is equal on every member and unique within this group (for store key prefixes).
  virtual std::shared_ptr<ProcessGroup> run_new_group(const std::vector<int>& ranks, int group_rank,
                                                      uint64_t group_id) = 0;

  /// Numbers an operation and describes it; public methods call it before run_*.
  /// The next sequence number and the operation's label (`tensor`'s size and dtype where given).
  OpContext make_context(const char* name, Milliseconds timeout, const at::Tensor* tensor);

  /// Notes `work` (the operation `ctx` names) among recent_operations(); returns it.
  std::shared_ptr<Work> record(const OpContext& ctx, std::shared_ptr<Work> work);
  /// record(ctx, run()); when run() throws, the operation is noted as failed, then rethrown.
  template <typename Run>
  std::shared_ptr<Work> recorded(const OpContext& ctx, Run&& run) {
    try {
      return record(ctx, run());
    } catch (...) {
      record_failure(ctx, std::current_exception());
      throw;
    }
  }
  void record_failure(const OpContext& ctx, std::exception_ptr error);

  /// For a backend about to report a time-out (or a stopped peer): every rank's last operations,
  /// a block of lines starting with a newline, to append to the message; "" when hang reports
  /// are off. Waits at most about 2 s for the other ranks. Never throws.
  std::string hang_report() const;
  /// What hang_report() uses, for Work objects that build their own time-out messages; may be null.
  std::shared_ptr<HangReporter> hang_reporter() const { return hang_reporter_; }

 private:
  int rank_;
  int size_;
  Milliseconds timeout_;
  std::atomic<uint64_t> sequence_{0};
  uint64_t groups_created_ = 0;
  bool check_collectives_ = false;
  // Fingerprint buffers of the collective check, allocated once per group: the check runs before
  // every collective, so it must not allocate per call.
  at::Tensor fingerprint_in_;
  std::vector<at::Tensor> fingerprint_all_;

  struct Recorded {
    OpLabel label;
    std::chrono::steady_clock::time_point start;
    std::weak_ptr<Work> work;
    bool attached = false;  ///< record() has given the Work (until then: in flight)
    char note[kNoteBytes] = {};  ///< AllreduceOptions::note, cut short; "" when none
    /// "allreduce #12 (4.0 MB float32, avg) [bucket 3: fc2.weight]"
    std::string describe() const;
  };
  // A fixed ring, slot = sequence % kRecentOperations: noting an operation on the hot path
  // (every bucket's allreduce) allocates nothing.
  mutable std::mutex recent_mutex_;
  std::array<Recorded, kRecentOperations> recent_{};
  uint64_t newest_recorded_ = 0;  ///< sequence of the last noted operation (0: none)
  std::shared_ptr<HangReporter> hang_reporter_;
  /// The slot holding operation `sequence`, or null once the ring has moved past it.
  Recorded* recent_slot(uint64_t sequence);

  // Exchanges this collective's fingerprint with every rank; returns a failed Work when they
  // disagree (or the exchange failed), null when the collective may run.
  std::shared_ptr<Work> check_same_collective(const OpContext& ctx);
};

}  // namespace shoal::comm
