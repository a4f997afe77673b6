// Small models for the DDP tests, with the layer structure (and PyTorch-style parameter names) of
// Shoal's CNN and MLP but smaller sizes, and deterministic synthetic batches.
#pragma once

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <string>
#include <vector>

namespace shoal::testing {

/// conv1 1->4 k3, conv2 4->8 k3, max-pool 2, fc1 128->32, fc2 32->10 on 1x12x12 inputs.
struct SmallCnnImpl : torch::nn::Module {
  SmallCnnImpl()
      : conv1(register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 4, 3)))),
        conv2(register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(4, 8, 3)))),
        fc1(register_module("fc1", torch::nn::Linear(128, 32))),
        fc2(register_module("fc2", torch::nn::Linear(32, 10))) {}
  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(conv1(x));
    x = torch::relu(conv2(x));
    x = torch::max_pool2d(x, 2).flatten(1);
    x = torch::relu(fc1(x));
    return torch::log_softmax(fc2(x), 1);
  }
  torch::nn::Conv2d conv1, conv2;
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(SmallCnn);

/// fc1 20->32, fc2 32->32, fc3 32->10 (other input and hidden widths on request).
struct SmallMlpImpl : torch::nn::Module {
  explicit SmallMlpImpl(int64_t in = 20, int64_t hidden = 32)
      : fc1(register_module("fc1", torch::nn::Linear(in, hidden))),
        fc2(register_module("fc2", torch::nn::Linear(hidden, hidden))),
        fc3(register_module("fc3", torch::nn::Linear(hidden, 10))) {}
  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(fc1(x));
    x = torch::relu(fc2(x));
    return torch::log_softmax(fc3(x), 1);
  }
  torch::nn::Linear fc1, fc2, fc3;
};
TORCH_MODULE(SmallMlp);

/// The input shape of one sample of each model.
inline std::vector<int64_t> sample_shape(const std::string& model) {
  return model == "cnn" ? std::vector<int64_t>{1, 12, 12} : std::vector<int64_t>{20};
}

/// Batch `step` of the whole world (deterministic, any thread): inputs and labels.
inline std::pair<torch::Tensor, torch::Tensor> make_batch(const std::string& model, int64_t step,
                                                          int64_t global_batch) {
  auto generator = at::make_generator<at::CPUGeneratorImpl>(1000 + step);
  std::vector<int64_t> shape{global_batch};
  for (auto d : sample_shape(model)) shape.push_back(d);
  auto x = torch::randn(shape, generator, torch::kFloat);
  auto y = torch::randint(0, 10, {global_batch}, generator, torch::kLong);
  return {x, y};
}

/// Max |a - b| / max |b| over every tensor pair (0 when equal).
inline double max_relative_difference(const std::vector<torch::Tensor>& a,
                                      const std::vector<torch::Tensor>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double scale = std::max(b[i].abs().max().item<double>(), 1e-12);
    worst = std::max(worst, (a[i] - b[i]).abs().max().item<double>() / scale);
  }
  return worst;
}

/// `steps` SGD steps (lr 0.05, momentum 0.9) of `forward`, whose parameters are `params`, on
/// make_batch("mlp", step, batch): nll_loss of log_softmax(forward(x)). Two runs give the same
/// parameters when `forward` computes the same function however it splits the work.
template <typename Forward>
void train_on_mlp_batches(const std::vector<torch::Tensor>& params, Forward forward,
                          int64_t batch, int64_t steps) {
  torch::optim::SGD sgd(params, torch::optim::SGDOptions(0.05).momentum(0.9));
  for (int64_t step = 0; step < steps; ++step) {
    auto [x, y] = make_batch("mlp", step, batch);
    sgd.zero_grad();
    torch::nll_loss(torch::log_softmax(forward(x), 1), y).backward();
    sgd.step();
  }
}

inline std::vector<torch::Tensor> clone_all(const std::vector<torch::Tensor>& tensors) {
  std::vector<torch::Tensor> out;
  for (const auto& t : tensors) out.push_back(t.detach().clone());
  return out;
}

}  // namespace shoal::testing
