// The model, closed-form weights and data of the FullyShardedDataParallel tests
// (test_fully_sharded_data_parallel.cpp, test_fsdp_vs_pytorch.cpp); zero_oracle.py builds the
// same in Python.
#pragma once

#include <torch/torch.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace shoal::testing::fsdp_model {

// A module that passes its input through: its parameter never gets a gradient.
struct PassThroughImpl : torch::nn::Module {
  PassThroughImpl() { extra = register_parameter("extra", torch::randn({5})); }
  at::Tensor forward(at::Tensor x) { return x; }
  at::Tensor extra;
};
TORCH_MODULE(PassThrough);

// Linear 6->13 (91 parameters, uneven for 2 and 3 ranks), BatchNorm, Linear 13->11, an unused
// parameter, Linear 11->3: the model of zero_oracle.py, with the same parameter names.
inline torch::nn::Sequential make_model() {
  return torch::nn::Sequential(torch::nn::Linear(6, 13), torch::nn::BatchNorm1d(13),
                               torch::nn::ReLU(), torch::nn::Linear(13, 11), PassThrough(),
                               torch::nn::ReLU(), torch::nn::Linear(11, 3),
                               torch::nn::LogSoftmax(1));
}

// The closed-form global batch of `step` (zero_oracle.py computes the same).
inline std::pair<at::Tensor, at::Tensor> batch(int64_t step, int64_t size) {
  auto x = (torch::sin(0.01 * (torch::arange(size * 6, torch::kDouble) + 977.0 * step)) * 2)
               .to(torch::kFloat)
               .view({size, 6});
  auto y = (torch::arange(size, torch::kLong) * 7 + step).remainder(3);
  return {x, y};
}

// Closed-form initial weights (zero_oracle.py computes the same), on rank 0 only: the wrappers
// must broadcast them.
inline void set_initial_weights(torch::nn::Module& model) {
  torch::NoGradGuard no_grad;
  int64_t index = 0;
  for (auto& p : model.parameters()) {
    auto k = torch::arange(p.numel(), torch::kDouble);
    p.copy_((0.3 * torch::sin(0.37 * k + static_cast<double>(index))).to(torch::kFloat).view(p.sizes()));
    ++index;
  }
}

inline std::unique_ptr<torch::optim::Optimizer> make_optimizer(const std::string& kind,
                                                         const std::vector<at::Tensor>& params) {
  if (kind == "adam") {
    // eps 1e-3, not Adam's 1e-8: with eps near zero a gradient of 1e-9 and one of 1e-11 both move
    // a weight by about lr, so float rounding that differs between LibTorch builds (2e-7 on SGD
    // between 1.13 and 2.x) would be amplified past any tolerance (0.6 % measured); the oracle
    // (zero_oracle.py) uses the same eps.
    return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(0.01).eps(1e-3));
  }
  if (kind == "adamw") {
    // Adam's eps (see above) and a weight decay large enough to matter in 20 steps.
    return std::make_unique<torch::optim::AdamW>(
        params, torch::optim::AdamWOptions(0.01).eps(1e-3).weight_decay(0.1));
  }
  return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.05).momentum(0.9));
}

// The module's parameters then buffers (cloned), after training.
inline std::vector<at::Tensor> state_of(torch::nn::Module& module) {
  std::vector<at::Tensor> out;
  for (const auto& p : module.parameters()) out.push_back(p.detach().clone());
  for (const auto& b : module.buffers()) out.push_back(b.detach().clone().to(torch::kDouble));
  return out;
}

}  // namespace shoal::testing::fsdp_model
