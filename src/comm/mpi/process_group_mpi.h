// ProcessGroupMpi: Shoal's process group over OpenMPI, for jobs started by mpirun or srun.
//
// Debian's LibTorch has no MPI backend, so this is Shoal's own (it does not use c10d's). Each group
// owns a duplicate of its communicator and one worker thread that runs the queued collectives in
// order, as c10d's backends do. MPI's blocking calls cannot time out, so every operation is started
// non-blocking (MPI_Iallreduce, ...) and polled with MPI_Test against a deadline. On a time-out the
// operation fails with a TimeoutError naming the ranks that did not reach it (found by a failure
// notice exchanged on a second communicator), and the group is aborted: every later operation
// fails at once. float16/bfloat16 are reduced through a float32 copy; avg is a sum then a division.
// Point-to-point operations are started on the caller's thread (a send queued behind a receive on
// one worker could deadlock a ring) and polled by Work::wait.
//
// Thread safety: as ProcessGroup.
#pragma once

// Only MPI's C API is used; its deprecated C++ bindings would need libmpi_cxx at link time.
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "shoal/comm/process_group.h"

namespace shoal::comm {

class PromiseWork;

class ProcessGroupMpi : public ProcessGroup {
 public:
  /// The group of every process of MPI_COMM_WORLD (initializes MPI when needed).
  static std::shared_ptr<ProcessGroupMpi> create_world(Milliseconds timeout);

  /// Takes ownership of `comm` (freed in the destructor).
  ProcessGroupMpi(MPI_Comm comm, Milliseconds timeout);
  ~ProcessGroupMpi() override;

  std::string backend_name() const override { return "mpi"; }
  void abort(const std::string& reason) override;

  /// Polls `requests` until every one completes or `deadline` passes (false then).
  static bool poll(std::vector<MPI_Request>& requests,
                   std::chrono::steady_clock::time_point deadline);

  /// Names the ranks that did not report the failure of operation `sequence` within `budget`,
  /// after telling every other rank that this one failed it. Used on time-outs.
  std::string diagnose(uint64_t sequence, Milliseconds budget);

  /// Keeps `requests` and the buffers they use alive for good: MPI may still write into them.
  void abandon(std::vector<MPI_Request> requests, std::vector<at::Tensor> buffers);

  /// The reason the group was aborted, or empty.
  std::string abort_reason();

 protected:
  std::shared_ptr<Work> run_allreduce(at::Tensor& tensor, ReduceOp op,
                                      const OpContext& ctx) override;
  std::shared_ptr<Work> run_broadcast(at::Tensor& tensor, int root, const OpContext& ctx) override;
  std::shared_ptr<Work> run_reduce(at::Tensor& tensor, int root, ReduceOp op,
                                   const OpContext& ctx) override;
  std::shared_ptr<Work> run_allgather(std::vector<at::Tensor>& outputs, const at::Tensor& input,
                                      const OpContext& ctx) override;
  std::shared_ptr<Work> run_reduce_scatter(at::Tensor& output, std::vector<at::Tensor>& inputs,
                                           ReduceOp op, const OpContext& ctx) override;
  std::shared_ptr<Work> run_gather(std::vector<at::Tensor>& outputs, const at::Tensor& input,
                                   int root, const OpContext& ctx) override;
  std::shared_ptr<Work> run_scatter(at::Tensor& output, std::vector<at::Tensor>& inputs, int root,
                                    const OpContext& ctx) override;
  std::shared_ptr<Work> run_send(const at::Tensor& tensor, int dst, int tag,
                                 const OpContext& ctx) override;
  std::shared_ptr<Work> run_recv(at::Tensor& tensor, int src, int tag,
                                 const OpContext& ctx) override;
  std::shared_ptr<Work> run_barrier(const OpContext& ctx) override;
  std::shared_ptr<ProcessGroup> run_new_group(const std::vector<int>& ranks, int group_rank,
                                              uint64_t group_id) override;

 private:
  // One queued collective: `start` posts the non-blocking MPI call(s) and returns their requests
  // and the buffers they use; `finish` runs after they completed (copy-back, division).
  struct Started {
    std::vector<MPI_Request> requests;
    std::vector<at::Tensor> buffers;
    std::function<void()> finish;
  };
  struct Task {
    OpContext ctx;
    std::function<Started()> start;
    std::shared_ptr<PromiseWork> work;
  };

  std::shared_ptr<Work> enqueue(const OpContext& ctx, std::function<Started()> start);
  void run_worker();
  void execute(Task& task);
  std::shared_ptr<Work> failed_work(const OpContext& ctx);

  MPI_Comm comm_;     // collectives and point-to-point data
  MPI_Comm control_;  // failure notices only, so they never match a data message

  std::mutex mutex_;
  std::condition_variable queue_cv_;
  std::deque<Task> queue_;
  bool running_ = false;  // a task is being executed (by the worker or inline by the caller)
  bool stop_ = false;
  std::string abort_reason_;
  std::atomic<bool> aborted_{false};
  std::atomic<bool> in_blocking_call_{false};
  std::vector<MPI_Request> abandoned_requests_;
  std::vector<at::Tensor> abandoned_buffers_;
  std::vector<std::unique_ptr<uint64_t>> notices_;  // payloads of failure notices in flight
  std::thread worker_;
};

}  // namespace shoal::comm
