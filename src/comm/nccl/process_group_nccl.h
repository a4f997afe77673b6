// ProcessGroupNccl: Shoal's process group over c10d's ProcessGroupNCCL, for CUDA tensors (one GPU
// per process). Compiled only against a LibTorch with CUDA (SHOAL_HAVE_NCCL).
//
// Adds Shoal's time-outs, collective checks and errors that name the rank, the operation with its
// sequence number and the peer at fault; a CPU tensor is refused with a message that says so.
//
// Thread safety: as ProcessGroup.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "shoal/comm/process_group.h"
#include "shoal/comm/store.h"

namespace shoal::compat {
class NativeWork;
class NcclGroup;
}

namespace shoal::comm {

class PeerDirectory;

class ProcessGroupNccl : public ProcessGroup {
 public:
  /// `device` is this rank's CUDA device index (made current here).
  ProcessGroupNccl(std::shared_ptr<Store> store, int rank, int size, Milliseconds timeout,
                   int device);
  ~ProcessGroupNccl() override;

  std::string backend_name() const override { return "nccl"; }
  int device() const { return device_; }
  bool takes_cuda_tensors() const override { return true; }

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
  std::shared_ptr<Work> track(const OpContext& ctx, std::unique_ptr<compat::NativeWork> native);
  void require_cuda(const at::Tensor& tensor, const OpContext& ctx) const;

  std::shared_ptr<Store> store_;
  int device_;
  std::unique_ptr<compat::NcclGroup> nccl_;
  std::shared_ptr<PeerDirectory> peers_;
};

}  // namespace shoal::comm
