#include "shoal/ps/shard_optimizer.h"

#include <ATen/ATen.h>

#include <cmath>

#include "shoal/error.h"

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

void Adam::step(uint32_t key, at::Tensor& param, const at::Tensor& grad, double lr_factor) {
  // In the order of LibTorch's (and PyTorch 1.13's single-tensor) Adam, so the rounding agrees.
  const double lr = options_.lr * lr_factor;
  KeyState& s = states_[key];
  if (!s.exp_avg.defined()) {
    s.exp_avg = at::zeros_like(param);
    s.exp_avg_sq = at::zeros_like(param);
  }
  s.step += 1;
  at::Tensor g = grad;
  if (options_.weight_decay != 0) {
    if (options_.decoupled_weight_decay) {
      param.mul_(1 - lr * options_.weight_decay);
    } else {
      g = grad.add(param, options_.weight_decay);
    }
  }
  const double bias_correction1 = 1 - std::pow(options_.beta1, static_cast<double>(s.step));
  const double bias_correction2 = 1 - std::pow(options_.beta2, static_cast<double>(s.step));
  s.exp_avg.mul_(options_.beta1).add_(g, 1 - options_.beta1);
  s.exp_avg_sq.mul_(options_.beta2).addcmul_(g, g, 1 - options_.beta2);
  const at::Tensor denom = (s.exp_avg_sq.sqrt() / std::sqrt(bias_correction2)).add_(options_.eps);
  param.addcdiv_(s.exp_avg, denom, -lr / bias_correction1);
}

std::map<std::string, at::Tensor> Adam::state(uint32_t key) const {
  const auto found = states_.find(key);
  if (found == states_.end()) return {};
  return {{"step", at::scalar_tensor(static_cast<double>(found->second.step), at::kFloat)},
          {"exp_avg", found->second.exp_avg},
          {"exp_avg_sq", found->second.exp_avg_sq}};
}

void Adam::load_state(uint32_t key, const std::map<std::string, at::Tensor>& state) {
  const auto avg = state.find("exp_avg");
  const auto avg_sq = state.find("exp_avg_sq");
  const auto step = state.find("step");
  if (avg == state.end() && avg_sq == state.end()) return;  // the key had not stepped yet
  SHOAL_CHECK_T(CheckpointError, avg != state.end() && avg_sq != state.end() && step != state.end(),
                "parameter-server shard state of key ", key,
                " lacks step/exp_avg/exp_avg_sq: it was not saved by Adam");
  SHOAL_CHECK_T(CheckpointError, avg->second.sizes() == avg_sq->second.sizes() && step->second.numel() == 1,
                "parameter-server shard state of key ", key, " has mismatched Adam buffers");
  KeyState s;
  s.step = static_cast<int64_t>(step->second.item<double>());
  s.exp_avg = avg->second.to(at::kFloat).clone();
  s.exp_avg_sq = avg_sq->second.to(at::kFloat).clone();
  states_[key] = std::move(s);
}

std::unique_ptr<ShardOptimizer> Adam::clone() const {
  auto copy = std::make_unique<Adam>(options_);
  for (const auto& [key, s] : states_) {
    copy->states_[key] = KeyState{s.step, s.exp_avg.clone(), s.exp_avg_sq.clone()};
  }
  return copy;
}

}  // namespace shoal::ps
