// C10dGroup: the narrow interface over one c10d backend (ProcessGroupGloo, ProcessGroupNCCL) that
// Shoal's backends on c10d build on; LibTorch version differences (c10d::ProcessGroup in 1.13,
// c10d::Backend in 2.x) are handled in compat/. Errors come out as std::exception with c10d's text;
// the Shoal backend turns them into Shoal errors that name rank, operation and peer.
//
// Thread safety: as c10d's backends: one thread issues operations; handles may be waited on from
// any thread.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <vector>

#include "shoal/comm/types.h"

namespace shoal::compat {

/// A pending c10d operation.
class NativeWork {
 public:
  virtual ~NativeWork() = default;
  virtual bool is_completed() = 0;
  /// Returns true when done within `timeout`, false when still running; throws the op's error.
  virtual bool wait(comm::Milliseconds timeout) = 0;
};

class C10dGroup {
 public:
  virtual ~C10dGroup();

  std::unique_ptr<NativeWork> allreduce(at::Tensor& tensor, comm::ReduceOp op,
                                        comm::Milliseconds timeout);
  std::unique_ptr<NativeWork> broadcast(at::Tensor& tensor, int root, comm::Milliseconds timeout);
  std::unique_ptr<NativeWork> reduce(at::Tensor& tensor, int root, comm::ReduceOp op,
                                     comm::Milliseconds timeout);
  std::unique_ptr<NativeWork> allgather(std::vector<at::Tensor>& outputs, const at::Tensor& input,
                                        comm::Milliseconds timeout);
  /// Not every backend has it (NCCL does, Gloo does not).
  std::unique_ptr<NativeWork> reduce_scatter(at::Tensor& output, std::vector<at::Tensor>& inputs,
                                             comm::ReduceOp op, comm::Milliseconds timeout);
  std::unique_ptr<NativeWork> gather(std::vector<at::Tensor>& outputs, const at::Tensor& input,
                                     int root, comm::Milliseconds timeout);
  std::unique_ptr<NativeWork> scatter(at::Tensor& output, std::vector<at::Tensor>& inputs,
                                      int root, comm::Milliseconds timeout);
  std::unique_ptr<NativeWork> send(const at::Tensor& tensor, int dst, int tag);
  std::unique_ptr<NativeWork> recv(at::Tensor& tensor, int src, int tag);
  std::unique_ptr<NativeWork> barrier(comm::Milliseconds timeout);

  /// Gives up on the c10d group without destroying it: its destructor joins c10d's worker threads,
  /// which may be stuck in a receive from a stopped peer until c10d's own time-out (10 min by
  /// default). After a failed operation the group is of no further use, so it is leaked on
  /// purpose, its threads left to end with the process. Call at most once, before destruction.
  void abandon();

 protected:
  C10dGroup();
  struct Impl;  // compat/c10d_group_impl.h
  std::unique_ptr<Impl> impl_;
};

}  // namespace shoal::compat
