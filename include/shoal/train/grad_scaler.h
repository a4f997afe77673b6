// Dynamic loss scaling for float16 training: PyTorch's torch.amp.GradScaler, with its option
// names, its defaults and its state_dict keys. The loss is multiplied by a scale before backward
// so that small float16 gradients do not flush to zero; unscale_() divides the gradients back and
// notes whether any of them is inf or NaN; step() skips the optimizer step when one was; update()
// halves the scale after such a step and doubles it after growth_interval clean ones.
//
// The recipe, as in Python:
//   scaler.scale(loss).backward();
//   scaler.unscale_(optimizer);              // optional: before clipping the true gradients
//   clip_grad_norm_(params, max_norm);
//   scaler.step(optimizer);                  // skipped when a gradient was inf/NaN
//   scaler.update();
//
// Device-agnostic: the scale and the found-inf flag live on the gradients' device; step() reads
// the flag back once per step (as PyTorch's does). Across processes whose gradients differ (model
// or pipeline stages, shards), set found_inf_across so that every process skips the same steps.
//
// Thread safety: none of its own; use it from the thread that runs the training step.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace torch::optim {
class Optimizer;
}

namespace shoal::train {

/// torch.amp.GradScaler's constructor arguments, with its defaults.
struct GradScalerOptions {
  /// The first scale: 2^16.
  TORCH_ARG(double, init_scale) = 65536.0;
  /// The scale is multiplied by this after growth_interval steps without inf/NaN gradients.
  TORCH_ARG(double, growth_factor) = 2.0;
  /// ... and by this after a step with one (which is skipped).
  TORCH_ARG(double, backoff_factor) = 0.5;
  /// Clean steps between growths.
  TORCH_ARG(int64_t, growth_interval) = 2000;
  /// false: scale() returns the loss as it is, step() always steps, update() does nothing.
  TORCH_ARG(bool, enabled) = true;
};

class GradScaler {
 public:
  explicit GradScaler(GradScalerOptions options = {});

  /// Sums values across the processes in place (Strategy::all_reduce_sum). Set: the found-inf
  /// flag is summed across them, so that all skip a step together.
  void set_found_inf_across(std::function<void(std::vector<double>&)> sum_across);

  /// loss * scale (the loss itself when disabled).
  at::Tensor scale(const at::Tensor& loss);

  /// Divides the gradients of `optimizer`'s parameters by the scale in place and records whether
  /// any of them is inf or NaN. At most once per step (between update()s); throws otherwise.
  void unscale_(torch::optim::Optimizer& optimizer);

  /// unscale_() unless already done, then optimizer.step() unless a gradient was inf/NaN.
  /// Returns whether the optimizer stepped.
  bool step(torch::optim::Optimizer& optimizer);

  /// The new scale for the next step: backoff after a skipped step, growth after growth_interval
  /// clean ones. `new_scale` set: that value, as update(new_scale) does in PyTorch.
  void update(std::optional<double> new_scale = std::nullopt);

  /// The current scale (1.0 when disabled, as PyTorch returns).
  double get_scale() const;
  bool is_enabled() const { return options_.enabled(); }
  /// Clean steps since the last growth or backoff.
  int64_t growth_tracker() const { return growth_tracker_; }
  /// Whether the last unscale_() found an inf or NaN gradient (on any process).
  bool found_inf() const { return found_inf_value_; }

  /// PyTorch's keys: scale, growth_factor, backoff_factor, growth_interval, _growth_tracker
  /// (empty when disabled, as PyTorch's).
  std::map<std::string, double> state_dict() const;
  /// Restores what state_dict() gave (or what PyTorch's state_dict() holds).
  void load_state_dict(const std::map<std::string, double>& state);

  const GradScalerOptions& options() const { return options_; }

 private:
  GradScalerOptions options_;
  double scale_;
  int64_t growth_tracker_ = 0;
  std::function<void(std::vector<double>&)> sum_across_;
  // Per step: unscaled -> (stepped) -> update() resets.
  bool unscaled_ = false;
  bool stepped_ = false;
  bool found_inf_value_ = false;
};

}  // namespace shoal::train
