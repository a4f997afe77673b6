// GlooGroup: the narrow interface over c10d's ProcessGroupGloo (LibTorch 1.13 and 2.x).
//
// The Gloo backend (src/comm/gloo/) builds on this and nothing else from c10d; a LibTorch version
// difference is handled here. Errors come out as std::exception with c10d's text; the backend
// turns them into Shoal errors that name rank, operation and peer.
//
// Thread safety: as c10d's ProcessGroupGloo: one thread issues operations; handles may be waited
// on from any thread.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <string>
#include <vector>

#include "shoal/comm/store.h"
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

class GlooGroup {
 public:
  /// `hostname` is the address the other ranks reach this one at ("127.0.0.1" on one host);
  /// `interface`, when not empty, names the network interface instead (GLOO_SOCKET_IFNAME).
  GlooGroup(std::shared_ptr<comm::Store> store, int rank, int size, comm::Milliseconds timeout,
            const std::string& hostname, const std::string& interface = "");
  ~GlooGroup();

  /// Whether Gloo reduces this dtype natively (else the backend converts).
  static bool supports_dtype(at::ScalarType type);

  std::unique_ptr<NativeWork> allreduce(at::Tensor& tensor, comm::ReduceOp op,
                                        comm::Milliseconds timeout);
  std::unique_ptr<NativeWork> broadcast(at::Tensor& tensor, int root, comm::Milliseconds timeout);
  std::unique_ptr<NativeWork> reduce(at::Tensor& tensor, int root, comm::ReduceOp op,
                                     comm::Milliseconds timeout);
  std::unique_ptr<NativeWork> allgather(std::vector<at::Tensor>& outputs, const at::Tensor& input,
                                        comm::Milliseconds timeout);
  std::unique_ptr<NativeWork> gather(std::vector<at::Tensor>& outputs, const at::Tensor& input,
                                     int root, comm::Milliseconds timeout);
  std::unique_ptr<NativeWork> scatter(at::Tensor& output, std::vector<at::Tensor>& inputs,
                                      int root, comm::Milliseconds timeout);
  std::unique_ptr<NativeWork> send(const at::Tensor& tensor, int dst, int tag);
  std::unique_ptr<NativeWork> recv(at::Tensor& tensor, int src, int tag);
  std::unique_ptr<NativeWork> barrier(comm::Milliseconds timeout);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace shoal::compat
