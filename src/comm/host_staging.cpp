#include "comm/host_staging.h"

#include <ATen/ATen.h>

#include <mutex>

namespace shoal::comm {

struct HostStaging::State {
  // std::list: the references handed to the backend stay valid while more are added.
  std::list<at::Tensor> hosts;
  std::list<std::vector<at::Tensor>> host_lists;
  std::vector<std::pair<at::Tensor, at::Tensor>> copy_back;  // (device tensor, host tensor)
};

namespace {

bool is_staged_device(const at::Tensor& tensor) { return tensor.defined() && tensor.is_cuda(); }

at::Tensor pinned_copy(const at::Tensor& device, bool read) {
  at::Tensor host = at::empty(device.sizes(), device.options().device(at::kCPU).pinned_memory(true));
  if (read) host.copy_(device);
  return host;
}

// Completes when the backend's Work has, then copies the outputs back to their devices (once).
class StagedWork : public Work {
 public:
  StagedWork(std::shared_ptr<Work> inner, std::shared_ptr<HostStaging::State> state)
      : Work(inner->label()), inner_(std::move(inner)), state_(std::move(state)) {}

  bool is_completed() override {
    if (!inner_->is_completed()) return false;
    copy_back();
    return true;
  }
  void wait(Milliseconds timeout) override {
    inner_->wait(timeout);
    copy_back();
  }
  std::exception_ptr exception() override { return inner_->exception(); }

 private:
  void copy_back() {
    std::call_once(copied_, [&] {
      if (inner_->exception()) return;  // a failed operation leaves the device tensors as they were
      for (auto& [device, host] : state_->copy_back) device.copy_(host);
    });
  }

  std::shared_ptr<Work> inner_;
  std::shared_ptr<HostStaging::State> state_;
  std::once_flag copied_;
};

}  // namespace

HostStaging::HostStaging(bool stage_cuda) : stage_cuda_(stage_cuda) {}

at::Tensor& HostStaging::tensor(at::Tensor& tensor, bool read, bool written) {
  if (!stage_cuda_ || !is_staged_device(tensor)) return tensor;
  if (!state_) state_ = std::make_shared<State>();
  at::Tensor& host = state_->hosts.emplace_back(pinned_copy(tensor, read));
  if (written) state_->copy_back.emplace_back(tensor, host);
  return host;
}

std::vector<at::Tensor>& HostStaging::list(std::vector<at::Tensor>& tensors, bool read,
                                           bool written) {
  bool any = false;
  for (const auto& t : tensors) any = any || is_staged_device(t);
  if (!stage_cuda_ || !any) return tensors;
  if (!state_) state_ = std::make_shared<State>();
  auto& hosts = state_->host_lists.emplace_back();
  hosts.reserve(tensors.size());
  for (auto& t : tensors) {
    hosts.push_back(is_staged_device(t) ? pinned_copy(t, read) : t);
    if (written && is_staged_device(t)) state_->copy_back.emplace_back(t, hosts.back());
  }
  return hosts;
}

std::shared_ptr<Work> HostStaging::finish(std::shared_ptr<Work> work) {
  if (!state_) return work;
  return std::make_shared<StagedWork>(std::move(work), state_);
}

}  // namespace shoal::comm
