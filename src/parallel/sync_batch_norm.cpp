#include "shoal/parallel/sync_batch_norm.h"

#include <torch/torch.h>

#include "shoal/error.h"

namespace shoal::parallel {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Dimensions reduced per channel: all but dimension 1.
std::vector<int64_t> reduce_dims(const at::Tensor& x) {
  std::vector<int64_t> dims{0};
  for (int64_t d = 2; d < x.dim(); ++d) dims.push_back(d);
  return dims;
}

// (C) -> (1, C, 1, ...) to broadcast against the input.
at::Tensor per_channel(const at::Tensor& t, const at::Tensor& like) {
  std::vector<int64_t> shape(like.dim(), 1);
  shape[1] = t.numel();
  return t.view(shape);
}

// The custom autograd function: statistics and their gradients are summed across ranks.
struct SyncBatchNormFunction : public torch::autograd::Function<SyncBatchNormFunction> {
  // Returns {output, mean, biased variance, global count}.
  static variable_list forward(AutogradContext* ctx, at::Tensor input, at::Tensor weight,
                               at::Tensor bias, int64_t group_address, double eps) {
    auto* group = reinterpret_cast<comm::ProcessGroup*>(group_address);
    const auto dims = reduce_dims(input);
    const int64_t channels = input.size(1);
    auto x = input.to(torch::kFloat);
    auto stats = torch::cat({x.sum(dims), (x * x).sum(dims),
                             torch::full({1}, static_cast<double>(input.numel() / channels))});
    group->allreduce(stats)->wait();
    auto count = stats[2 * channels];
    auto mean = stats.narrow(0, 0, channels) / count;
    auto var = (stats.narrow(0, channels, channels) / count - mean * mean).clamp_min(0);
    auto invstd = torch::rsqrt(var + eps);
    auto out = (x - per_channel(mean, x)) * per_channel(invstd, x);
    if (weight.defined()) out = out * per_channel(weight, x) + per_channel(bias, x);
    ctx->save_for_backward({input, weight, mean, invstd});
    ctx->saved_data["group"] = group_address;
    ctx->saved_data["count"] = count.item<double>();
    ctx->mark_non_differentiable({mean, var});
    return {out.to(input.scalar_type()), mean, var, count.reshape({1})};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    auto input = saved[0].to(torch::kFloat), weight = saved[1], mean = saved[2], invstd = saved[3];
    auto* group = reinterpret_cast<comm::ProcessGroup*>(ctx->saved_data["group"].toInt());
    const double count = ctx->saved_data["count"].toDouble();
    const auto dims = reduce_dims(input);
    const int64_t channels = input.size(1);
    auto dy = grads[0].to(torch::kFloat);
    auto xmu = input - per_channel(mean, input);
    auto sum_dy = dy.sum(dims);
    auto sum_dy_xmu = (dy * xmu).sum(dims);
    // Weight and bias gradients stay local: DDP averages them like any other gradient.
    at::Tensor grad_weight, grad_bias;
    if (weight.defined()) {
      grad_weight = sum_dy_xmu * invstd;
      grad_bias = sum_dy.clone();
    }
    auto global = torch::cat({sum_dy, sum_dy_xmu});
    group->allreduce(global)->wait();
    auto mean_dy = global.narrow(0, 0, channels) / count;
    auto mean_dy_xmu = global.narrow(0, channels, channels) / count;
    auto scale = weight.defined() ? invstd * weight : invstd;
    auto grad_input = (dy - per_channel(mean_dy, dy) -
                       xmu * per_channel(invstd * invstd * mean_dy_xmu, dy)) *
                      per_channel(scale, dy);
    return {grad_input.to(grads[0].scalar_type()), grad_weight, grad_bias, at::Tensor(),
            at::Tensor()};
  }
};

}  // namespace

SyncBatchNormImpl::SyncBatchNormImpl(torch::nn::BatchNormOptions options_,
                                     std::shared_ptr<comm::ProcessGroup> group_)
    : options(std::move(options_)), group(std::move(group_)) {
  SHOAL_CHECK_T(InvalidArgument, group != nullptr, "SyncBatchNorm: the process group is null");
  reset();
}

void SyncBatchNormImpl::reset() {
  const int64_t c = options.num_features();
  if (options.affine()) {
    weight = register_parameter("weight", torch::ones({c}));
    bias = register_parameter("bias", torch::zeros({c}));
  }
  if (options.track_running_stats()) {
    running_mean = register_buffer("running_mean", torch::zeros({c}));
    running_var = register_buffer("running_var", torch::ones({c}));
    num_batches_tracked = register_buffer("num_batches_tracked", torch::zeros({}, torch::kLong));
  }
}

at::Tensor SyncBatchNormImpl::forward(const at::Tensor& input) {
  SHOAL_CHECK_T(InvalidArgument, input.dim() >= 2 && input.size(1) == options.num_features(),
                "SyncBatchNorm: expected input (N, ", options.num_features(), ", ...), got ",
                input.sizes());
  const bool use_batch_stats = is_training() || !options.track_running_stats();
  if (!use_batch_stats) {
    return torch::batch_norm(input, weight, bias, running_mean, running_var, false, 0.0,
                             options.eps(), false);
  }
  auto results = SyncBatchNormFunction::apply(input, weight, bias,
                                              reinterpret_cast<int64_t>(group.get()), options.eps());
  if (is_training() && options.track_running_stats()) {
    torch::NoGradGuard no_grad;
    const double n = results[3].item<double>();
    num_batches_tracked += 1;
    const double momentum = options.momentum().has_value()
                                ? *options.momentum()
                                : 1.0 / num_batches_tracked.item<double>();
    running_mean.mul_(1 - momentum).add_(results[1], momentum);
    running_var.mul_(1 - momentum).add_(results[2] * (n / std::max(n - 1, 1.0)), momentum);
  }
  return results[0];
}

namespace {

template <typename Impl>
SyncBatchNorm from_batch_norm(const Impl& bn, const std::shared_ptr<comm::ProcessGroup>& group) {
  const auto& o = bn.options;
  SyncBatchNorm sync(torch::nn::BatchNormOptions(o.num_features())
                         .eps(o.eps())
                         .momentum(o.momentum())
                         .affine(o.affine())
                         .track_running_stats(o.track_running_stats()),
                     group);
  torch::NoGradGuard no_grad;
  if (o.affine()) {
    sync->weight.copy_(bn.weight);
    sync->bias.copy_(bn.bias);
  }
  if (o.track_running_stats()) {
    sync->running_mean.copy_(bn.running_mean);
    sync->running_var.copy_(bn.running_var);
    sync->num_batches_tracked.copy_(bn.num_batches_tracked);
  }
  return sync;
}

bool holds_batch_norm(torch::nn::Module& module) {
  for (const auto& child : module.modules(/*include_self=*/true)) {
    if (child->as<torch::nn::BatchNorm1dImpl>() || child->as<torch::nn::BatchNorm2dImpl>()) {
      return true;
    }
  }
  return false;
}

}  // namespace

std::shared_ptr<torch::nn::Module> convert_sync_batchnorm(std::shared_ptr<torch::nn::Module> module,
                                                          std::shared_ptr<comm::ProcessGroup> group) {
  SHOAL_CHECK_T(InvalidArgument, module != nullptr, "convert_sync_batchnorm: the module is null");
  if (auto* bn = module->as<torch::nn::BatchNorm1dImpl>()) return from_batch_norm(*bn, group).ptr();
  if (auto* bn = module->as<torch::nn::BatchNorm2dImpl>()) return from_batch_norm(*bn, group).ptr();
  if (auto* seq = module->as<torch::nn::SequentialImpl>()) {
    torch::nn::Sequential converted;
    auto names = seq->named_children().keys();
    size_t i = 0;
    for (auto& item : *seq) {
      auto child = item.ptr();
      const std::string& name = names[i++];
      if (child->as<torch::nn::BatchNorm1dImpl>() || child->as<torch::nn::BatchNorm2dImpl>()) {
        converted->push_back(name, std::dynamic_pointer_cast<SyncBatchNormImpl>(
                                       convert_sync_batchnorm(child, group)));
      } else {
        SHOAL_CHECK_T(InvalidArgument, !holds_batch_norm(*child), "convert_sync_batchnorm: '", name,
                      "' holds a BatchNorm inside a custom module, whose typed members cannot be "
                      "swapped from outside in C++; declare that layer as "
                      "shoal::parallel::SyncBatchNorm instead");
        converted->push_back(name, item);
      }
    }
    return converted.ptr();
  }
  SHOAL_CHECK_T(InvalidArgument, !holds_batch_norm(*module),
                "convert_sync_batchnorm: module '", module->name(), "' holds a BatchNorm in a typed "
                "member, which cannot be swapped from outside in C++; declare that layer as "
                "shoal::parallel::SyncBatchNorm, or build the model as a torch::nn::Sequential");
  return module;
}

}  // namespace shoal::parallel
