// The optimizer a parameter server applies to the key ranges it owns. Its state (momentum
// buffers, ...) lives on the server, keyed by key id, and is saved with the shard.
//
// To add an optimizer, derive from ShardOptimizer: step() updates one key range in place from
// its gradient, with its learning rate times the factor the pushing worker's schedule gives
// (PyTorch's LambdaLR: lr = base lr x factor; 1 without a schedule); state() / load_state()
// expose the per-key tensors for checkpoints.
//
// Thread safety: used by one server thread. Each Server works on its own clone() of the
// optimizer in ServerOptions, so one ServerOptions can start several servers in one process.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>

namespace shoal::ps {

class ShardOptimizer {
 public:
  virtual ~ShardOptimizer() = default;
  /// Updates `param` (a flat float32 range, in place) with `grad` (same shape), at the learning
  /// rate times `lr_factor` (finite, >= 0).
  virtual void step(uint32_t key, at::Tensor& param, const at::Tensor& grad, double lr_factor) = 0;
  /// Per-key state tensors by name ("momentum_buffer"); empty when the key has none yet.
  virtual std::map<std::string, at::Tensor> state(uint32_t key) const = 0;
  /// Restores what state() returned.
  virtual void load_state(uint32_t key, const std::map<std::string, at::Tensor>& state) = 0;
  /// A copy with the same hyper-parameters and its own copy of the state.
  virtual std::unique_ptr<ShardOptimizer> clone() const = 0;
};

/// torch.optim.SGD's update (dampening 0, no Nesterov, no weight decay):
/// buf = grad on the first step, else momentum * buf + grad; param -= lr * lr_factor * buf
/// (a scheduler changing SGD's lr changes it for the whole buffer, as here).
struct SgdOptions {
  double lr = 0.01;
  double momentum = 0;
};

class Sgd : public ShardOptimizer {
 public:
  explicit Sgd(SgdOptions options) : options_(options) {}
  void step(uint32_t key, at::Tensor& param, const at::Tensor& grad, double lr_factor) override;
  std::map<std::string, at::Tensor> state(uint32_t key) const override;
  void load_state(uint32_t key, const std::map<std::string, at::Tensor>& state) override;
  std::unique_ptr<ShardOptimizer> clone() const override;
  const SgdOptions& options() const { return options_; }

 private:
  SgdOptions options_;
  std::map<uint32_t, at::Tensor> momentum_buffers_;
};

/// torch.optim.Adam's update (amsgrad off), or AdamW's with `decoupled_weight_decay`: per
/// key, step += 1; with weight decay, grad += weight_decay * param (Adam) or
/// param *= 1 - lr * weight_decay (AdamW); exp_avg = beta1 * exp_avg + (1 - beta1) * grad;
/// exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * grad^2; param -= lr / (1 - beta1^step) *
/// exp_avg / (sqrt(exp_avg_sq) / sqrt(1 - beta2^step) + eps), lr being lr x lr_factor. Its state
/// per key is PyTorch's: "step" (a 0-dim float32 tensor), "exp_avg", "exp_avg_sq".
struct AdamOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0;
  bool decoupled_weight_decay = false;  ///< true: AdamW
};

class Adam : public ShardOptimizer {
 public:
  explicit Adam(AdamOptions options) : options_(options) {}
  void step(uint32_t key, at::Tensor& param, const at::Tensor& grad, double lr_factor) override;
  std::map<std::string, at::Tensor> state(uint32_t key) const override;
  void load_state(uint32_t key, const std::map<std::string, at::Tensor>& state) override;
  std::unique_ptr<ShardOptimizer> clone() const override;
  const AdamOptions& options() const { return options_; }

 private:
  struct KeyState {
    int64_t step = 0;
    at::Tensor exp_avg;
    at::Tensor exp_avg_sq;
  };
  AdamOptions options_;
  std::map<uint32_t, KeyState> states_;
};

}  // namespace shoal::ps
