// ProcessGroupMultiDevice: one process group whose operations go to a backend per device type, as
// PyTorch 2.x's `init_process_group(backend="cpu:gloo,cuda:nccl")` does: CPU tensors to a CPU
// backend (shm, gloo, mpi, hierarchical), CUDA tensors to NCCL. `--backend auto` builds one when
// this process sees a GPU and NCCL is built in, so a program that reduces both CPU tensors
// (metrics, the trainer's counters) and CUDA tensors (DDP's buckets) needs one group, not two.
//
// Spec: "cpu:BACKEND,cuda:BACKEND" (either order; "cpu" alone is allowed). Every rank must give
// the same spec. Each child group meets in a store prefix of its own and numbers its own
// operations; this group numbers every operation too, and runs the collective check once, here
// (through the CPU child), so the children are called with their checks off.
//
// Which child runs what:
//   a collective or send/recv        the child of the tensor's device type (all tensors of one
//                                    call must be on one device type: InvalidArgument otherwise)
//   barrier, empty_symmetric          the CPU child (a barrier is a host-side synchronisation; PyTorch
//                                    2.x's runs on the default device, which needs no GPU here)
//   new_group                        a new group of both children over the same ranks
//   abort                            both children
//
// Thread safety: as ProcessGroup.
#pragma once

#include <c10/core/DeviceType.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "shoal/comm/process_group.h"

namespace shoal::comm {

class ProcessGroupMultiDevice : public ProcessGroup {
 public:
  /// `children`: a process group per device type, each over the same ranks; kCPU is required.
  ProcessGroupMultiDevice(std::map<c10::DeviceType, std::shared_ptr<ProcessGroup>> children,
                          Milliseconds timeout);
  ~ProcessGroupMultiDevice() override;

  /// "cpu:shm,cuda:nccl": the spec it was built from.
  std::string backend_name() const override;
  void abort(const std::string& reason) override;
  bool is_symmetric(const at::Tensor& tensor) const override;
  /// With a CUDA backend; without one, CUDA tensors are staged through host memory to the CPU one.
  bool takes_cuda_tensors() const override { return children_.count(c10::DeviceType::CUDA) > 0; }

  /// The child that runs operations on tensors of `type`, or null when none does.
  ProcessGroup* backend_for(c10::DeviceType type) const;

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
  at::Tensor run_empty_symmetric(int64_t numel, at::ScalarType dtype,
                                 const OpContext& ctx) override;
  std::shared_ptr<ProcessGroup> run_new_group(const std::vector<int>& ranks, int group_rank,
                                              uint64_t group_id) override;

 private:
  /// The child for `tensor` (and every tensor of `others`, which must share its device type).
  ProcessGroup& child(const OpContext& ctx, const at::Tensor& tensor,
                      const std::vector<at::Tensor>& others = {}) const;

  std::map<c10::DeviceType, std::shared_ptr<ProcessGroup>> children_;
};

/// Whether `spec` names backends per device type ("cpu:shm,cuda:nccl").
bool is_multi_device_spec(const std::string& spec);

/// The spec's parts: device type -> backend name. Throws InvalidArgument naming what is wrong
/// (unknown device type, a type named twice, no cpu part, an empty backend).
std::map<c10::DeviceType, std::string> parse_multi_device_spec(const std::string& spec);

}  // namespace shoal::comm
