#include "shoal/ps/shard_optimizer.h"

namespace shoal::ps {

void Sgd::step(uint32_t key, at::Tensor& param, const at::Tensor& grad, double lr_factor) {
  at::Tensor direction = grad;
  if (options_.momentum != 0) {
    auto found = momentum_buffers_.find(key);
    if (found == momentum_buffers_.end()) {
      found = momentum_buffers_.emplace(key, grad.clone()).first;
    } else {
      found->second.mul_(options_.momentum).add_(grad);
    }
    direction = found->second;
  }
  param.add_(direction, -options_.lr * lr_factor);
}

std::map<std::string, at::Tensor> Sgd::state(uint32_t key) const {
  const auto found = momentum_buffers_.find(key);
  if (found == momentum_buffers_.end()) return {};
  return {{"momentum_buffer", found->second}};
}

void Sgd::load_state(uint32_t key, const std::map<std::string, at::Tensor>& state) {
  const auto found = state.find("momentum_buffer");
  if (found != state.end()) momentum_buffers_[key] = found->second.clone();
}

std::unique_ptr<ShardOptimizer> Sgd::clone() const {
  auto copy = std::make_unique<Sgd>(options_);
  for (const auto& [key, buffer] : momentum_buffers_) copy->momentum_buffers_[key] = buffer.clone();
  return copy;
}

}  // namespace shoal::ps
