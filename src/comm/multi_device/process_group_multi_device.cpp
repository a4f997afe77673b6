#include "comm/multi_device/process_group_multi_device.h"

#include <ATen/core/Tensor.h>

#include <sstream>

#include "shoal/error.h"

namespace shoal::comm {
namespace {

// The device types a spec may name, with their spelling in it (PyTorch's).
const char* type_name(c10::DeviceType type) {
  switch (type) {
    case c10::DeviceType::CPU: return "cpu";
    case c10::DeviceType::CUDA: return "cuda";
    default: return "other";
  }
}

// The CPU child, which gives the group its rank and size (checked before the base is built).
const ProcessGroup& cpu_child(
    const std::map<c10::DeviceType, std::shared_ptr<ProcessGroup>>& children) {
  auto it = children.find(c10::DeviceType::CPU);
  SHOAL_CHECK_T(InvalidArgument, it != children.end() && it->second,
                "a multi-device process group needs a CPU backend (e.g. cpu:shm,cuda:nccl)");
  return *it->second;
}

}  // namespace

bool is_multi_device_spec(const std::string& spec) { return spec.find(':') != std::string::npos; }

std::map<c10::DeviceType, std::string> parse_multi_device_spec(const std::string& spec) {
  std::map<c10::DeviceType, std::string> parts;
  std::stringstream in(spec);
  std::string part;
  while (std::getline(in, part, ',')) {
    const auto colon = part.find(':');
    SHOAL_CHECK_T(InvalidArgument, colon != std::string::npos && colon > 0 && colon + 1 < part.size(),
                  "backend '", spec, "': '", part,
                  "' is not DEVICE:BACKEND; write e.g. cpu:shm,cuda:nccl");
    const std::string device = part.substr(0, colon);
    const std::string backend = part.substr(colon + 1);
    c10::DeviceType type;
    if (device == "cpu") {
      type = c10::DeviceType::CPU;
    } else if (device == "cuda") {
      type = c10::DeviceType::CUDA;
    } else {
      SHOAL_THROW(InvalidArgument, "backend '", spec, "': device type '", device,
                  "' is not known; use cpu and cuda (e.g. cpu:shm,cuda:nccl)");
    }
    SHOAL_CHECK_T(InvalidArgument, backend.find(':') == std::string::npos, "backend '", spec,
                  "': '", part, "' names more than one backend; separate the parts with commas");
    SHOAL_CHECK_T(InvalidArgument, parts.emplace(type, backend).second, "backend '", spec,
                  "' names a backend for ", device, " twice");
  }
  SHOAL_CHECK_T(InvalidArgument, parts.count(c10::DeviceType::CPU) == 1, "backend '", spec,
                "' has no cpu part: barriers and the collective check run on CPU tensors, so "
                "name a CPU backend too (e.g. cpu:shm,cuda:nccl)");
  return parts;
}

ProcessGroupMultiDevice::ProcessGroupMultiDevice(
    std::map<c10::DeviceType, std::shared_ptr<ProcessGroup>> children, Milliseconds timeout)
    : ProcessGroup(cpu_child(children).rank(), cpu_child(children).size(), timeout),
      children_(std::move(children)) {
  for (auto& [type, group] : children_) {
    SHOAL_CHECK_T(InvalidArgument, group && group->rank() == rank() && group->size() == size(),
                  rank_prefix(), " the ", type_name(type),
                  " backend of a multi-device group must span the same ranks as its cpu backend");
    // The check runs once, here: its fingerprint exchange is a CPU allgather on the CPU child.
    group->set_check_collectives(false);
  }
}

ProcessGroupMultiDevice::~ProcessGroupMultiDevice() = default;

std::string ProcessGroupMultiDevice::backend_name() const {
  std::string name;
  for (const auto& [type, group] : children_) {
    name += (name.empty() ? "" : ",") + std::string(type_name(type)) + ":" + group->backend_name();
  }
  return name;
}

void ProcessGroupMultiDevice::abort(const std::string& reason) {
  for (auto& entry : children_) entry.second->abort(reason);
}

bool ProcessGroupMultiDevice::is_symmetric(const at::Tensor& tensor) const {
  return children_.at(c10::DeviceType::CPU)->is_symmetric(tensor);
}

ProcessGroup* ProcessGroupMultiDevice::backend_for(c10::DeviceType type) const {
  auto it = children_.find(type);
  return it == children_.end() ? nullptr : it->second.get();
}

ProcessGroup& ProcessGroupMultiDevice::child(const OpContext& ctx, const at::Tensor& tensor,
                                             const std::vector<at::Tensor>& others) const {
  const c10::DeviceType type = tensor.device().type();
  for (const auto& other : others) {
    SHOAL_CHECK_T(InvalidArgument, other.device().type() == type, ctx.prefix(), ": its tensors are on ",
                  tensor.device().str(), " and ", other.device().str(),
                  "; a multi-device group runs each operation on one device type");
  }
  ProcessGroup* group = backend_for(type);
  SHOAL_CHECK_T(InvalidArgument, group != nullptr, ctx.prefix(), ": the tensor is on ",
                tensor.device().str(), " and this group (", backend_name(),
                ") has no backend for that device type");
  return *group;
}

std::shared_ptr<Work> ProcessGroupMultiDevice::run_allreduce(at::Tensor& tensor, ReduceOp op,
                                                             const OpContext& ctx) {
  AllreduceOptions options;
  options.op = op;
  options.timeout = ctx.timeout;
  options.check = false;
  return child(ctx, tensor).allreduce(tensor, options);
}

std::shared_ptr<Work> ProcessGroupMultiDevice::run_broadcast(at::Tensor& tensor, int root,
                                                             const OpContext& ctx) {
  return child(ctx, tensor).broadcast(tensor, {root, ctx.timeout});
}

std::shared_ptr<Work> ProcessGroupMultiDevice::run_reduce(at::Tensor& tensor, int root, ReduceOp op,
                                                          const OpContext& ctx) {
  return child(ctx, tensor).reduce(tensor, {root, op, ctx.timeout});
}

std::shared_ptr<Work> ProcessGroupMultiDevice::run_allgather(std::vector<at::Tensor>& outputs,
                                                             const at::Tensor& input,
                                                             const OpContext& ctx) {
  return child(ctx, input, outputs).allgather(outputs, input, {ctx.timeout});
}

std::shared_ptr<Work> ProcessGroupMultiDevice::run_reduce_scatter(at::Tensor& output,
                                                                  std::vector<at::Tensor>& inputs,
                                                                  ReduceOp op,
                                                                  const OpContext& ctx) {
  return child(ctx, output, inputs).reduce_scatter(output, inputs, {op, ctx.timeout});
}

std::shared_ptr<Work> ProcessGroupMultiDevice::run_gather(std::vector<at::Tensor>& outputs,
                                                          const at::Tensor& input, int root,
                                                          const OpContext& ctx) {
  return child(ctx, input, outputs).gather(outputs, input, {root, ctx.timeout});
}

std::shared_ptr<Work> ProcessGroupMultiDevice::run_scatter(at::Tensor& output,
                                                           std::vector<at::Tensor>& inputs,
                                                           int root, const OpContext& ctx) {
  return child(ctx, output, inputs).scatter(output, inputs, {root, ctx.timeout});
}

std::shared_ptr<Work> ProcessGroupMultiDevice::run_send(const at::Tensor& tensor, int dst, int tag,
                                                        const OpContext& ctx) {
  return child(ctx, tensor).send(tensor, dst, {tag, ctx.timeout});
}

std::shared_ptr<Work> ProcessGroupMultiDevice::run_recv(at::Tensor& tensor, int src, int tag,
                                                        const OpContext& ctx) {
  return child(ctx, tensor).recv(tensor, src, {tag, ctx.timeout});
}

std::shared_ptr<Work> ProcessGroupMultiDevice::run_barrier(const OpContext& ctx) {
  return children_.at(c10::DeviceType::CPU)->barrier({ctx.timeout});
}

at::Tensor ProcessGroupMultiDevice::run_empty_symmetric(int64_t numel, at::ScalarType dtype,
                                                        const OpContext& ctx) {
  return children_.at(c10::DeviceType::CPU)->empty_symmetric(numel, dtype, ctx.timeout);
}

std::shared_ptr<ProcessGroup> ProcessGroupMultiDevice::run_new_group(const std::vector<int>& ranks,
                                                                     int group_rank,
                                                                     uint64_t group_id) {
  (void)group_rank;
  (void)group_id;
  // Every child is asked in the same (device type) order on every rank: new_group is a collective.
  std::map<c10::DeviceType, std::shared_ptr<ProcessGroup>> children;
  for (auto& [type, group] : children_) children[type] = group->new_group(ranks);
  return std::make_shared<ProcessGroupMultiDevice>(std::move(children), timeout());
}

}  // namespace shoal::comm
