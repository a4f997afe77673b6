#include "shoal/train/grad_scaler.h"

#include "shoal/error.h"

#include <ATen/ATen.h>
#include <torch/optim/optimizer.h>

#include <cmath>

namespace shoal::train {
namespace {

// PyTorch keeps the scale in a float32 tensor: every value it takes is rounded to float.
double as_float32(double value) { return static_cast<double>(static_cast<float>(value)); }

}  // namespace

GradScaler::GradScaler(GradScalerOptions options)
    : options_(options), scale_(as_float32(options.init_scale())) {
  SHOAL_CHECK_T(InvalidArgument, options_.init_scale() > 0 && std::isfinite(options_.init_scale()),
                "GradScaler: init_scale must be a positive number, got ", options_.init_scale());
  SHOAL_CHECK_T(InvalidArgument, options_.growth_factor() > 1.0,
                "GradScaler: growth_factor must be > 1, got ", options_.growth_factor());
  SHOAL_CHECK_T(InvalidArgument, options_.backoff_factor() > 0 && options_.backoff_factor() < 1.0,
                "GradScaler: backoff_factor must be in (0, 1), got ", options_.backoff_factor());
  SHOAL_CHECK_T(InvalidArgument, options_.growth_interval() > 0,
                "GradScaler: growth_interval must be > 0, got ", options_.growth_interval());
}

void GradScaler::set_found_inf_across(std::function<void(std::vector<double>&)> sum_across) {
  sum_across_ = std::move(sum_across);
}

at::Tensor GradScaler::scale(const at::Tensor& loss) {
  if (!is_enabled()) return loss;
  // As PyTorch: a one-element float32 scale, so a float16 loss is scaled (and backpropagated
  // from) in float32.
  return loss * at::full({1}, scale_, loss.options().dtype(at::kFloat));
}

void GradScaler::unscale_(torch::optim::Optimizer& optimizer) {
  if (!is_enabled()) return;
  SHOAL_CHECK(!unscaled_, "GradScaler: unscale_() has already been called on this optimizer "
                          "since the last update()");
  SHOAL_CHECK(!stepped_, "GradScaler: unscale_() is being called after step()");
  // PyTorch: the reciprocal in double, rounded to float32.
  const double inv_scale = static_cast<float>(1.0 / scale_);
  at::Tensor found;  // one flag on the gradients' device; read back once below
  at::NoGradGuard no_grad;
  for (auto& group : optimizer.param_groups()) {
    for (auto& p : group.params()) {
      at::Tensor g = p.grad();
      if (!g.defined()) continue;
      at::Tensor bad = g.isfinite().logical_not().any().to(at::kFloat).reshape({1});
      if (!found.defined()) {
        found = bad;
      } else {
        found.add_(bad.to(found.device()));
      }
      g.mul_(at::full({}, inv_scale, g.options().dtype(at::kFloat)));
    }
  }
  std::vector<double> flag{found.defined() ? found.item<double>() : 0.0};
  // Processes whose gradients differ (stages, shards, replicas of a pipeline) agree here; DDP
  // replicas, whose averaged gradients are equal, would agree anyway.
  if (sum_across_) sum_across_(flag);
  found_inf_value_ = flag[0] > 0;
  unscaled_ = true;
}

bool GradScaler::step(torch::optim::Optimizer& optimizer) {
  if (!is_enabled()) {
    optimizer.step();
    return true;
  }
  SHOAL_CHECK(!stepped_, "GradScaler: step() has already been called since the last update()");
  if (!unscaled_) unscale_(optimizer);
  stepped_ = true;
  if (found_inf_value_) return false;
  optimizer.step();
  return true;
}

void GradScaler::update(std::optional<double> new_scale) {
  if (!is_enabled()) return;
  if (new_scale) {
    SHOAL_CHECK_T(InvalidArgument, *new_scale > 0 && std::isfinite(*new_scale),
                  "GradScaler::update: new_scale must be a positive number, got ", *new_scale);
    scale_ = as_float32(*new_scale);
  } else {
    SHOAL_CHECK(unscaled_, "GradScaler: no inf checks were recorded prior to update() "
                           "(call step() or unscale_() first)");
    if (found_inf_value_) {
      scale_ = as_float32(scale_ * options_.backoff_factor());
      growth_tracker_ = 0;
    } else if (++growth_tracker_ == options_.growth_interval()) {
      // As torch._amp_update_scale_: an overflowing growth keeps the old scale.
      const double grown = as_float32(scale_ * options_.growth_factor());
      if (std::isfinite(grown)) scale_ = grown;
      growth_tracker_ = 0;
    }
  }
  unscaled_ = false;
  stepped_ = false;
  found_inf_value_ = false;
}

double GradScaler::get_scale() const { return is_enabled() ? scale_ : 1.0; }

std::map<std::string, double> GradScaler::state_dict() const {
  if (!is_enabled()) return {};
  return {{"scale", scale_},
          {"growth_factor", options_.growth_factor()},
          {"backoff_factor", options_.backoff_factor()},
          {"growth_interval", static_cast<double>(options_.growth_interval())},
          {"_growth_tracker", static_cast<double>(growth_tracker_)}};
}

void GradScaler::load_state_dict(const std::map<std::string, double>& state) {
  SHOAL_CHECK_T(InvalidArgument, is_enabled(),
                "GradScaler::load_state_dict: this scaler is disabled (enabled=false)");
  SHOAL_CHECK_T(InvalidArgument, !state.empty(),
                "GradScaler::load_state_dict: the state is empty; was it saved by a disabled "
                "scaler?");
  for (const char* key : {"scale", "growth_factor", "backoff_factor", "growth_interval",
                          "_growth_tracker"}) {
    SHOAL_CHECK_T(InvalidArgument, state.count(key), "GradScaler::load_state_dict: no '", key,
                  "' in the state");
  }
  scale_ = as_float32(state.at("scale"));
  options_.growth_factor(state.at("growth_factor"));
  options_.backoff_factor(state.at("backoff_factor"));
  options_.growth_interval(static_cast<int64_t>(state.at("growth_interval")));
  growth_tracker_ = static_cast<int64_t>(state.at("_growth_tracker"));
}

}  // namespace shoal::train
