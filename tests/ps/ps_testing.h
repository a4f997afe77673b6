// Helpers shared by the parameter-server tests: a tiny model, and a server on a thread.
#pragma once

#include <torch/torch.h>

#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "shoal/ps/server.h"
#include "shoal/ps/worker.h"

namespace shoal::ps::testing {

/// Linear(8,16)-ReLU-Linear(16,4): small and fast, with tensors large enough to be split over
/// servers when the split threshold is lowered.
struct TinyNetImpl : torch::nn::Module {
  TinyNetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(8, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 4));
  }
  torch::Tensor forward(torch::Tensor x) { return fc2(torch::relu(fc1(x))); }
  torch::nn::Linear fc1{nullptr};
  torch::nn::Linear fc2{nullptr};
};
TORCH_MODULE(TinyNet);

// The seed and the construction under one lock: workers are threads, and the generator is the
// process's; unlocked, a thread seeded 7 could build its net from another's seed (which made bsp
// differ from the single-process run by 0.6 when the threads were starved).
inline TinyNet make_tiny_net(uint64_t seed) {
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  torch::manual_seed(seed);
  return TinyNet();
}

inline std::vector<std::pair<std::string, at::Tensor>> named(torch::nn::Module& module) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& item : module.named_parameters()) out.emplace_back(item.key(), item.value());
  return out;
}

/// Servers on threads of this process; stopped and joined on destruction.
struct ServerSet {
  std::vector<std::unique_ptr<Server>> servers;
  ServerSet(int count, ServerOptions options) {
    for (int s = 0; s < count; ++s) {
      options.rank = s;
      servers.push_back(std::make_unique<Server>(options));
      servers.back()->start();
    }
  }
  std::vector<std::string> endpoints() const {
    std::vector<std::string> out;
    for (const auto& s : servers) out.push_back(s->endpoint());
    return out;
  }
  void join() {
    for (auto& s : servers) s->join();
  }
  ~ServerSet() {
    for (auto& s : servers) s->stop();
    join();
  }
};

inline WorkerOptions worker_options(const ServerSet& set, int rank, int num_workers) {
  WorkerOptions options;
  options.servers = set.endpoints();
  options.rank = rank;
  options.num_workers = num_workers;
  options.auth_token_from_env = false;
  options.timeout = std::chrono::milliseconds(20000);
  return options;
}

}  // namespace shoal::ps::testing
