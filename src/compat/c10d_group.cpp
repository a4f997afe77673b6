#include "compat/c10d_group.h"

#include "compat/c10d_group_impl.h"
#include "shoal/error.h"

namespace shoal::compat {
namespace {

c10d::ReduceOp to_c10d(comm::ReduceOp op, bool native_avg) {
  switch (op) {
    case comm::ReduceOp::kSum: return c10d::ReduceOp::SUM;
    case comm::ReduceOp::kMin: return c10d::ReduceOp::MIN;
    case comm::ReduceOp::kMax: return c10d::ReduceOp::MAX;
    case comm::ReduceOp::kProduct: return c10d::ReduceOp::PRODUCT;
    case comm::ReduceOp::kAvg:
      if (native_avg) return c10d::ReduceOp::AVG;
      break;
  }
  SHOAL_THROW(InvalidArgument, "this c10d backend cannot reduce with ", comm::to_string(op),
              " natively");
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
      if (std::string(e.what()).find("timed out") == std::string::npos) throw;
      if (!work_->isCompleted()) return false;
      // It completed in the moment between the wait giving up and this check (a peer arriving at
      // the end of a poll slice): its own outcome, which waiting now returns (or throws) at once.
      return work_->wait(timeout);
    }
  }

 private:
  c10::intrusive_ptr<c10d::Work> work_;
};

std::unique_ptr<NativeWork> wrap(c10::intrusive_ptr<c10d::Work> work) {
  return std::make_unique<C10dWork>(std::move(work));
}

}  // namespace

C10dGroup::C10dGroup() : impl_(std::make_unique<Impl>()) {}

C10dGroup::~C10dGroup() = default;

void C10dGroup::abandon() {
  // One reference leaked: the count never reaches zero, so ~ProcessGroupGloo never joins.
  (void)impl_->pg.release();
}

std::unique_ptr<NativeWork> C10dGroup::allreduce(at::Tensor& tensor, comm::ReduceOp op,
                                                 comm::Milliseconds timeout) {
  std::vector<at::Tensor> tensors{tensor};
  c10d::AllreduceOptions options;
  options.reduceOp = to_c10d(op, impl_->native_avg);
  options.timeout = timeout;
  return wrap(impl_->pg->allreduce(tensors, options));
}

std::unique_ptr<NativeWork> C10dGroup::broadcast(at::Tensor& tensor, int root,
                                                 comm::Milliseconds timeout) {
  std::vector<at::Tensor> tensors{tensor};
  c10d::BroadcastOptions options;
  options.rootRank = root;
  options.timeout = timeout;
  return wrap(impl_->pg->broadcast(tensors, options));
}

std::unique_ptr<NativeWork> C10dGroup::reduce(at::Tensor& tensor, int root, comm::ReduceOp op,
                                              comm::Milliseconds timeout) {
  std::vector<at::Tensor> tensors{tensor};
  c10d::ReduceOptions options;
  options.rootRank = root;
  options.reduceOp = to_c10d(op, impl_->native_avg);
  options.timeout = timeout;
  return wrap(impl_->pg->reduce(tensors, options));
}

std::unique_ptr<NativeWork> C10dGroup::allgather(std::vector<at::Tensor>& outputs,
                                                 const at::Tensor& input,
                                                 comm::Milliseconds timeout) {
  std::vector<std::vector<at::Tensor>> out{outputs};
  std::vector<at::Tensor> in{input};
  c10d::AllgatherOptions options;
  options.timeout = timeout;
  return wrap(impl_->pg->allgather(out, in, options));
}

std::unique_ptr<NativeWork> C10dGroup::reduce_scatter(at::Tensor& output,
                                                      std::vector<at::Tensor>& inputs,
                                                      comm::ReduceOp op,
                                                      comm::Milliseconds timeout) {
  std::vector<at::Tensor> out{output};
  std::vector<std::vector<at::Tensor>> in{inputs};
  c10d::ReduceScatterOptions options;
  options.reduceOp = to_c10d(op, impl_->native_avg);
  options.timeout = timeout;
  return wrap(impl_->pg->reduce_scatter(out, in, options));
}

std::unique_ptr<NativeWork> C10dGroup::gather(std::vector<at::Tensor>& outputs,
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

std::unique_ptr<NativeWork> C10dGroup::scatter(at::Tensor& output, std::vector<at::Tensor>& inputs,
                                               int root, comm::Milliseconds timeout) {
  std::vector<at::Tensor> out{output};
  std::vector<std::vector<at::Tensor>> in;
  if (!inputs.empty()) in.push_back(inputs);
  c10d::ScatterOptions options;
  options.rootRank = root;
  options.timeout = timeout;
  return wrap(impl_->pg->scatter(out, in, options));
}

std::unique_ptr<NativeWork> C10dGroup::send(const at::Tensor& tensor, int dst, int tag) {
  std::vector<at::Tensor> tensors{tensor};
  return wrap(impl_->pg->send(tensors, dst, tag));
}

std::unique_ptr<NativeWork> C10dGroup::recv(at::Tensor& tensor, int src, int tag) {
  std::vector<at::Tensor> tensors{tensor};
  return wrap(impl_->pg->recv(tensors, src, tag));
}

std::unique_ptr<NativeWork> C10dGroup::barrier(comm::Milliseconds timeout) {
  c10d::BarrierOptions options;
  options.timeout = timeout;
  return wrap(impl_->pg->barrier(options));
}

}  // namespace shoal::compat
