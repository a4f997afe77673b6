#include "comm/nccl/process_group_nccl.h"

#include <ATen/ATen.h>

#include "comm/backends.h"
#include "comm/native_backed_work.h"
#include "comm/peer_directory.h"
#include "compat/nccl_group.h"
#include "shoal/error.h"

namespace shoal::comm {

ProcessGroupNccl::ProcessGroupNccl(std::shared_ptr<Store> store, int rank, int size,
                                   Milliseconds timeout, int device)
    : ProcessGroup(rank, size, timeout), store_(std::move(store)), device_(device) {
  const int devices = compat::cuda_device_count();
  SHOAL_CHECK_T(InvalidArgument, devices > 0, rank_prefix(),
                " nccl: this process sees no CUDA GPU (the nccl backend needs one GPU per "
                "process); use --backend gloo or shm on CPU");
  SHOAL_CHECK_T(InvalidArgument, device >= 0 && device < devices, rank_prefix(),
                " nccl: CUDA device ", device, " does not exist (this process sees ", devices,
                "); give each process its own LOCAL_RANK below the number of GPUs");
  compat::set_cuda_device(device);
  peers_ = std::make_shared<PeerDirectory>(store_, "shoal/nccl", rank, size);
  try {
    nccl_ = std::make_unique<compat::NcclGroup>(make_prefix_store("shoal/nccl/ctx", store_), rank,
                                                size, timeout);
  } catch (const shoal::Error&) {
    throw;
  } catch (const std::exception& e) {
    std::string cause = e.what();
    SHOAL_THROW(PeerError, rank_prefix(), " nccl: could not create the process group: ",
                cause.substr(0, cause.find('\n')));
  }
}

ProcessGroupNccl::~ProcessGroupNccl() = default;

void ProcessGroupNccl::require_cuda(const at::Tensor& tensor, const OpContext& ctx) const {
  SHOAL_CHECK_T(InvalidArgument, tensor.is_cuda(), ctx.prefix(),
                ": the nccl backend reduces CUDA tensors only, and this one is on ",
                tensor.device().str(), " (move it with .to(torch::kCUDA), or use gloo/shm)");
}

std::shared_ptr<Work> ProcessGroupNccl::track(const OpContext& ctx,
                                              std::unique_ptr<compat::NativeWork> native) {
  return std::make_shared<NativeBackedWork>(ctx, std::move(native), peers_, hang_reporter(), nullptr);
}

std::shared_ptr<Work> ProcessGroupNccl::run_allreduce(at::Tensor& tensor, ReduceOp op,
                                                      const OpContext& ctx) {
  require_cuda(tensor, ctx);
  return track(ctx, nccl_->allreduce(tensor, op, ctx.timeout));
}

std::shared_ptr<Work> ProcessGroupNccl::run_broadcast(at::Tensor& tensor, int root,
                                                      const OpContext& ctx) {
  require_cuda(tensor, ctx);
  return track(ctx, nccl_->broadcast(tensor, root, ctx.timeout));
}

std::shared_ptr<Work> ProcessGroupNccl::run_reduce(at::Tensor& tensor, int root, ReduceOp op,
                                                   const OpContext& ctx) {
  require_cuda(tensor, ctx);
  return track(ctx, nccl_->reduce(tensor, root, op, ctx.timeout));
}

std::shared_ptr<Work> ProcessGroupNccl::run_allgather(std::vector<at::Tensor>& outputs,
                                                      const at::Tensor& input,
                                                      const OpContext& ctx) {
  require_cuda(input, ctx);
  return track(ctx, nccl_->allgather(outputs, input, ctx.timeout));
}

std::shared_ptr<Work> ProcessGroupNccl::run_reduce_scatter(at::Tensor& output,
                                                           std::vector<at::Tensor>& inputs,
                                                           ReduceOp op, const OpContext& ctx) {
  require_cuda(output, ctx);
  return track(ctx, nccl_->reduce_scatter(output, inputs, op, ctx.timeout));
}

std::shared_ptr<Work> ProcessGroupNccl::run_gather(std::vector<at::Tensor>& outputs,
                                                   const at::Tensor& input, int root,
                                                   const OpContext& ctx) {
  require_cuda(input, ctx);
  std::vector<at::Tensor> none;
  return track(ctx, nccl_->gather(rank() == root ? outputs : none, input, root, ctx.timeout));
}

std::shared_ptr<Work> ProcessGroupNccl::run_scatter(at::Tensor& output,
                                                    std::vector<at::Tensor>& inputs, int root,
                                                    const OpContext& ctx) {
  require_cuda(output, ctx);
  std::vector<at::Tensor> none;
  return track(ctx, nccl_->scatter(output, rank() == root ? inputs : none, root, ctx.timeout));
}

std::shared_ptr<Work> ProcessGroupNccl::run_send(const at::Tensor& tensor, int dst, int tag,
                                                 const OpContext& ctx) {
  require_cuda(tensor, ctx);
  return track(ctx, nccl_->send(tensor, dst, tag));
}

std::shared_ptr<Work> ProcessGroupNccl::run_recv(at::Tensor& tensor, int src, int tag,
                                                 const OpContext& ctx) {
  require_cuda(tensor, ctx);
  return track(ctx, nccl_->recv(tensor, src, tag));
}

std::shared_ptr<Work> ProcessGroupNccl::run_barrier(const OpContext& ctx) {
  return track(ctx, nccl_->barrier(ctx.timeout));
}

std::shared_ptr<ProcessGroup> ProcessGroupNccl::run_new_group(const std::vector<int>& ranks,
                                                              int group_rank, uint64_t group_id) {
  auto sub_store = make_prefix_store("shoal/nccl/group" + std::to_string(group_id), store_);
  return std::make_shared<ProcessGroupNccl>(sub_store, group_rank, static_cast<int>(ranks.size()),
                                            timeout(), device_);
}

std::shared_ptr<ProcessGroup> create_nccl_backend(const BackendArgs& args) {
  // One GPU per process: LOCAL_RANK picks it (as torchrun users expect), wrapping around when
  // a host runs more processes than it has GPUs.
  const int devices = compat::cuda_device_count();
  const int device = devices > 0 ? args.info.local_rank % devices : 0;
  return std::make_shared<ProcessGroupNccl>(args.store, args.rank, args.size, args.timeout,
                                            device);
}

}  // namespace shoal::comm
