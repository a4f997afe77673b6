// capture()/restore(): between a TrainingState and a live module, optimizer and generator.
#include <ATen/CPUGeneratorImpl.h>

#include "compat/optimizer_state.h"
#include "shoal/checkpoint/training_state.h"
#include "shoal/checkpoint/state_dict.h"
#include "shoal/error.h"
#include "shoal/log.h"

namespace shoal::checkpoint {
namespace {

namespace optim = torch::optim;

enum class Kind { kSgd, kAdam, kAdamW };

Kind kind_of(optim::OptimizerOptions& options) {
  if (dynamic_cast<optim::SGDOptions*>(&options)) return Kind::kSgd;
  if (dynamic_cast<optim::AdamOptions*>(&options)) return Kind::kAdam;
  if (dynamic_cast<optim::AdamWOptions*>(&options)) return Kind::kAdamW;
  SHOAL_THROW(InvalidArgument,
              "checkpoints support the optimizers SGD, Adam and AdamW; this one is none of them");
}

double as_double(const c10::IValue& v, const std::string& name) {
  if (v.isDouble()) return v.toDouble();
  if (v.isInt()) return static_cast<double>(v.toInt());
  if (v.isBool()) return v.toBool() ? 1.0 : 0.0;
  SHOAL_THROW(CheckpointError, "optimizer option '", name, "' is not a number");
}

/// Calls fn(name, value) for each option present in `options`.
template <typename Fn>
void for_present(const std::map<std::string, c10::IValue>& options, const char* name, Fn fn) {
  auto it = options.find(name);
  if (it != options.end() && !it->second.isNone()) fn(it->second);
}

template <typename AdamLikeOptions>
void capture_adam_options(AdamLikeOptions& o, std::map<std::string, c10::IValue>& out) {
  out["lr"] = o.lr();
  out["betas"] = c10::ivalue::Tuple::create({std::get<0>(o.betas()), std::get<1>(o.betas())});
  out["eps"] = o.eps();
  out["weight_decay"] = o.weight_decay();
  out["amsgrad"] = o.amsgrad();
  // What PyTorch 1.13 keeps in every Adam group; LibTorch has no such options (all off).
  out["maximize"] = false;
  out["foreach"] = c10::IValue();
  out["capturable"] = false;
  out["differentiable"] = false;
  out["fused"] = false;
}

template <typename AdamLikeOptions>
void restore_adam_options(const std::map<std::string, c10::IValue>& in, AdamLikeOptions& o) {
  for_present(in, "lr", [&](const c10::IValue& v) { o.lr(as_double(v, "lr")); });
  for_present(in, "eps", [&](const c10::IValue& v) { o.eps(as_double(v, "eps")); });
  for_present(in, "weight_decay",
              [&](const c10::IValue& v) { o.weight_decay(as_double(v, "weight_decay")); });
  for_present(in, "amsgrad", [&](const c10::IValue& v) { o.amsgrad(as_double(v, "amsgrad") != 0); });
  for_present(in, "betas", [&](const c10::IValue& v) {
    const auto items = v.isTuple() ? v.toTupleRef().elements().vec() : v.toListRef().vec();
    SHOAL_CHECK_T(CheckpointError, items.size() == 2, "optimizer option 'betas' must hold two numbers");
    o.betas(std::make_tuple(as_double(items[0], "betas"), as_double(items[1], "betas")));
  });
}

template <typename AdamLikeState>
void capture_adam_state(AdamLikeState& s, std::map<std::string, at::Tensor>& out) {
  // PyTorch 1.13 keeps Adam's step as a 0-dim float32 tensor.
  out["step"] = at::scalar_tensor(static_cast<double>(s.step()), at::kFloat);
  out["exp_avg"] = s.exp_avg();
  out["exp_avg_sq"] = s.exp_avg_sq();
  if (s.max_exp_avg_sq().defined()) out["max_exp_avg_sq"] = s.max_exp_avg_sq();
}

/// `source` as a fresh tensor like `param` (device, dtype), after checking its shape.
at::Tensor buffer_like(const at::Tensor& source, const at::Tensor& param, int64_t index,
                       const std::string& name) {
  SHOAL_CHECK_T(CheckpointError, source.sizes() == param.sizes(), "optimizer state '", name,
                "' of parameter ", index, " has shape ", source.sizes(), " but the parameter has ",
                param.sizes());
  if (check_dtype_change(source.scalar_type(), param.scalar_type(),
                         "optimizer state '" + name + "' of parameter " + std::to_string(index))) {
    log::warn("shoal: optimizer state '", name, "' of parameter ", index, " is cast from ",
              dtype_name(source.scalar_type()), " to the parameter's ", dtype_name(param.scalar_type()));
  }
  return source.to(param.device(), param.scalar_type(), /*non_blocking=*/false, /*copy=*/true);
}

template <typename AdamLikeState>
std::unique_ptr<optim::OptimizerParamState> restore_adam_state(
    const std::map<std::string, at::Tensor>& in, const at::Tensor& param, int64_t index) {
  auto state = std::make_unique<AdamLikeState>();
  auto get = [&](const char* name) -> const at::Tensor* {
    auto it = in.find(name);
    return it == in.end() ? nullptr : &it->second;
  };
  SHOAL_CHECK_T(CheckpointError, get("exp_avg") && get("exp_avg_sq"), "optimizer state of parameter ",
                index, " lacks exp_avg/exp_avg_sq: it was not saved by Adam");
  state->step(get("step") ? static_cast<int64_t>(get("step")->template item<double>()) : 0);
  state->exp_avg(buffer_like(*get("exp_avg"), param, index, "exp_avg"));
  state->exp_avg_sq(buffer_like(*get("exp_avg_sq"), param, index, "exp_avg_sq"));
  if (get("max_exp_avg_sq")) {
    state->max_exp_avg_sq(buffer_like(*get("max_exp_avg_sq"), param, index, "max_exp_avg_sq"));
  }
  return state;
}

}  // namespace

at::Tensor get_rng_state() {
  at::Generator generator = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(generator.mutex());
  return generator.get_state();
}

void set_rng_state(const at::Tensor& state) {
  at::Generator generator = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(generator.mutex());
  try {
    generator.set_state(state.cpu());
  } catch (const c10::Error& e) {
    SHOAL_THROW(CheckpointError, "the saved RNG state does not fit torch's CPU generator: ",
                e.what_without_backtrace());
  }
}

OptimizerState capture_optimizer(optim::Optimizer& optimizer) {
  OptimizerState out;
  int64_t index = 0;
  for (auto& group : optimizer.param_groups()) {
    ParamGroupState g;
    const Kind kind = kind_of(group.options());
    if (kind == Kind::kSgd) {
      auto& o = static_cast<optim::SGDOptions&>(group.options());
      g.options["lr"] = o.lr();
      g.options["momentum"] = o.momentum();
      g.options["dampening"] = o.dampening();
      g.options["weight_decay"] = o.weight_decay();
      g.options["nesterov"] = o.nesterov();
      g.options["maximize"] = false;  // PyTorch 1.13's other SGD options; LibTorch has none
      g.options["foreach"] = c10::IValue();
      g.options["differentiable"] = false;
    } else if (kind == Kind::kAdam) {
      capture_adam_options(static_cast<optim::AdamOptions&>(group.options()), g.options);
    } else {
      capture_adam_options(static_cast<optim::AdamWOptions&>(group.options()), g.options);
      g.options.erase("fused");  // PyTorch 1.13's AdamW has no 'fused'
    }
    for (const auto& param : group.params()) {
      g.params.push_back(index);
      if (auto* s = compat::find_param_state(optimizer, param)) {
        auto& buffers = out.state[index];
        if (kind == Kind::kSgd) {
          auto& sgd = static_cast<optim::SGDParamState&>(*s);
          if (sgd.momentum_buffer().defined()) buffers["momentum_buffer"] = sgd.momentum_buffer();
        } else if (kind == Kind::kAdam) {
          capture_adam_state(static_cast<optim::AdamParamState&>(*s), buffers);
        } else {
          capture_adam_state(static_cast<optim::AdamWParamState&>(*s), buffers);
        }
        if (buffers.empty()) out.state.erase(index);
      }
      ++index;
    }
    out.param_groups.push_back(std::move(g));
  }
  return out;
}

void restore_optimizer(const OptimizerState& state, optim::Optimizer& optimizer) {
  auto& groups = optimizer.param_groups();
  SHOAL_CHECK_T(CheckpointError, state.param_groups.size() == groups.size(), "the checkpoint's optimizer has ",
                state.param_groups.size(), " parameter group(s), this optimizer has ", groups.size());
  int64_t index = 0;
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    auto& group = groups[gi];
    const auto& saved = state.param_groups[gi];
    SHOAL_CHECK_T(CheckpointError, saved.params.size() == group.params().size(),
                  "parameter group ", gi, " of the checkpoint's optimizer has ", saved.params.size(),
                  " parameters, this optimizer's has ", group.params().size());
    const Kind kind = kind_of(group.options());
    if (kind == Kind::kSgd) {
      auto& o = static_cast<optim::SGDOptions&>(group.options());
      for_present(saved.options, "lr", [&](const c10::IValue& v) { o.lr(as_double(v, "lr")); });
      for_present(saved.options, "momentum", [&](const c10::IValue& v) { o.momentum(as_double(v, "momentum")); });
      for_present(saved.options, "dampening", [&](const c10::IValue& v) { o.dampening(as_double(v, "dampening")); });
      for_present(saved.options, "weight_decay",
                  [&](const c10::IValue& v) { o.weight_decay(as_double(v, "weight_decay")); });
      for_present(saved.options, "nesterov", [&](const c10::IValue& v) { o.nesterov(as_double(v, "nesterov") != 0); });
    } else if (kind == Kind::kAdam) {
      restore_adam_options(saved.options, static_cast<optim::AdamOptions&>(group.options()));
    } else {
      restore_adam_options(saved.options, static_cast<optim::AdamWOptions&>(group.options()));
    }
    for (size_t pi = 0; pi < group.params().size(); ++pi, ++index) {
      const at::Tensor& param = group.params()[pi];
      auto it = state.state.find(saved.params[pi]);
      if (it == state.state.end()) continue;
      const auto& buffers = it->second;
      if (kind == Kind::kSgd) {
        auto s = std::make_unique<optim::SGDParamState>();
        auto buf = buffers.find("momentum_buffer");
        SHOAL_CHECK_T(CheckpointError, buf != buffers.end(), "optimizer state of parameter ", index,
                      " lacks momentum_buffer: it was not saved by SGD");
        s->momentum_buffer(buffer_like(buf->second, param, index, "momentum_buffer"));
        compat::set_param_state(optimizer, param, std::move(s));
      } else if (kind == Kind::kAdam) {
        compat::set_param_state(optimizer, param, restore_adam_state<optim::AdamParamState>(buffers, param, index));
      } else {
        compat::set_param_state(optimizer, param, restore_adam_state<optim::AdamWParamState>(buffers, param, index));
      }
    }
  }
}

TrainingState capture(const torch::nn::Module& module, optim::Optimizer* optimizer) {
  TrainingState out;
  out.model = state_dict(module);
  if (optimizer != nullptr) out.optimizer = capture_optimizer(*optimizer);
  out.rng_state = get_rng_state();
  out.shoal_version = version();
  return out;
}

void restore(const TrainingState& state, torch::nn::Module& module, optim::Optimizer* optimizer,
             const RestoreOptions& options) {
  load_state_dict(module, state.model, options.strict);
  if (optimizer != nullptr && !state.optimizer.empty()) restore_optimizer(state.optimizer, *optimizer);
  if (options.restore_rng && state.rng_state.defined()) set_rng_state(state.rng_state);
}

}  // namespace shoal::checkpoint
