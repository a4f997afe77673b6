#include "compat/gloo_group.h"

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include "compat/c10d_store.h"
#include "compat/c10d_store_ref.h"
#include "shoal/error.h"

namespace shoal::compat {
namespace {

c10d::ReduceOp to_c10d(comm::ReduceOp op) {
  switch (op) {
    case comm::ReduceOp::kSum: return c10d::ReduceOp::SUM;
    case comm::ReduceOp::kMin: return c10d::ReduceOp::MIN;
    case comm::ReduceOp::kMax: return c10d::ReduceOp::MAX;
    case comm::ReduceOp::kProduct: return c10d::ReduceOp::PRODUCT;
    case comm::ReduceOp::kAvg: break;
  }
  SHOAL_THROW(InvalidArgument, "Gloo cannot reduce with ", comm::to_string(op), " natively");
}

class C10dWork : public NativeWork {
 public:
  explicit C10dWork(c10::intrusive_ptr<c10d::Work> work) : work_(std::move(work)) {}
  bool is_completed() override { return work_->isCompleted(); }
  bool wait(comm::Milliseconds timeout) override {
    try {
      return work_->wait(timeout);
    } catch (const std::exception& e) {
      // c10d reports a local time-out as a plain runtime_error; keep its text for the caller.
      if (std::string(e.what()).find("timed out") != std::string::npos && !work_->isCompleted()) {
        return false;
      }
      throw;
    }
  }

 private:
  c10::intrusive_ptr<c10d::Work> work_;
};

std::unique_ptr<NativeWork> wrap(c10::intrusive_ptr<c10d::Work> work) {
  return std::make_unique<C10dWork>(std::move(work));
}

}  // namespace

struct GlooGroup::Impl {
  c10::intrusive_ptr<c10d::ProcessGroupGloo> pg;
};

GlooGroup::GlooGroup(std::shared_ptr<comm::Store> store, int rank, int size,
                     comm::Milliseconds timeout, const std::string& hostname,
                     const std::string& interface)
    : impl_(std::make_unique<Impl>()) {
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  options->devices.push_back(
      interface.empty() ? c10d::ProcessGroupGloo::createDeviceForHostname(hostname)
                        : c10d::ProcessGroupGloo::createDeviceForInterface(interface));
  // Two worker threads let a second bucket's allreduce proceed while the first one finishes
  // (the same default as torch.distributed).
  options->threads = 2;
  auto ref = to_c10d_store(store);
  impl_->pg = c10::make_intrusive<c10d::ProcessGroupGloo>(ref->store, rank, size, options);
}

GlooGroup::~GlooGroup() = default;

bool GlooGroup::supports_dtype(at::ScalarType type) {
  switch (type) {
    case at::kFloat:
    case at::kDouble:
    case at::kHalf:
    case at::kInt:
    case at::kLong:
    case at::kByte:
    case at::kChar:
      return true;
    default:
      return false;
  }
}

std::unique_ptr<NativeWork> GlooGroup::allreduce(at::Tensor& tensor, comm::ReduceOp op,
                                                 comm::Milliseconds timeout) {
  std::vector<at::Tensor> tensors{tensor};
  c10d::AllreduceOptions options;
  options.reduceOp = to_c10d(op);
  options.timeout = timeout;
  return wrap(impl_->pg->allreduce(tensors, options));
}

std::unique_ptr<NativeWork> GlooGroup::broadcast(at::Tensor& tensor, int root,
                                                 comm::Milliseconds timeout) {
  std::vector<at::Tensor> tensors{tensor};
  c10d::BroadcastOptions options;
  options.rootRank = root;
  options.timeout = timeout;
  return wrap(impl_->pg->broadcast(tensors, options));
}

std::unique_ptr<NativeWork> GlooGroup::reduce(at::Tensor& tensor, int root, comm::ReduceOp op,
                                              comm::Milliseconds timeout) {
  std::vector<at::Tensor> tensors{tensor};
  c10d::ReduceOptions options;
  options.rootRank = root;
  options.reduceOp = to_c10d(op);
  options.timeout = timeout;
  return wrap(impl_->pg->reduce(tensors, options));
}

std::unique_ptr<NativeWork> GlooGroup::allgather(std::vector<at::Tensor>& outputs,
                                                 const at::Tensor& input,
                                                 comm::Milliseconds timeout) {
  std::vector<std::vector<at::Tensor>> out{outputs};
  std::vector<at::Tensor> in{input};
  c10d::AllgatherOptions options;
  options.timeout = timeout;
  return wrap(impl_->pg->allgather(out, in, options));
}

std::unique_ptr<NativeWork> GlooGroup::gather(std::vector<at::Tensor>& outputs,
                                              const at::Tensor& input, int root,
                                              comm::Milliseconds timeout) {
  std::vector<std::vector<at::Tensor>> out;
  if (!outputs.empty()) out.push_back(outputs);
  std::vector<at::Tensor> in{input};
  c10d::GatherOptions options;
  options.rootRank = root;
  options.timeout = timeout;
  return wrap(impl_->pg->gather(out, in, options));
}

std::unique_ptr<NativeWork> GlooGroup::scatter(at::Tensor& output, std::vector<at::Tensor>& inputs,
                                               int root, comm::Milliseconds timeout) {
  std::vector<at::Tensor> out{output};
  std::vector<std::vector<at::Tensor>> in;
  if (!inputs.empty()) in.push_back(inputs);
  c10d::ScatterOptions options;
  options.rootRank = root;
  options.timeout = timeout;
  return wrap(impl_->pg->scatter(out, in, options));
}

std::unique_ptr<NativeWork> GlooGroup::send(const at::Tensor& tensor, int dst, int tag) {
  std::vector<at::Tensor> tensors{tensor};
  return wrap(impl_->pg->send(tensors, dst, tag));
}

std::unique_ptr<NativeWork> GlooGroup::recv(at::Tensor& tensor, int src, int tag) {
  std::vector<at::Tensor> tensors{tensor};
  return wrap(impl_->pg->recv(tensors, src, tag));
}

std::unique_ptr<NativeWork> GlooGroup::barrier(comm::Milliseconds timeout) {
  c10d::BarrierOptions options;
  options.timeout = timeout;
  return wrap(impl_->pg->barrier(options));
}

}  // namespace shoal::compat
