#include "shoal/parallel/sync_batch_norm.h"

#include <torch/torch.h>

#include <map>

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

// The dtype statistics are computed in: the input's, but at least float32 (double stays double).
at::ScalarType compute_type(const at::Tensor& input) {
  return at::isFloatingType(input.scalar_type()) && c10::elementSize(input.scalar_type()) >= 4
             ? input.scalar_type()
             : at::kFloat;
}

// The custom autograd function: statistics and their gradients are summed across ranks.
struct SyncBatchNormFunction : public torch::autograd::Function<SyncBatchNormFunction> {
  // Returns {output, mean, biased variance, global count}.
  static variable_list forward(AutogradContext* ctx, at::Tensor input, at::Tensor weight,
                               at::Tensor bias, int64_t group_address, double eps) {
    auto* group = reinterpret_cast<comm::ProcessGroup*>(group_address);
    const auto dims = reduce_dims(input);
    const int64_t channels = input.size(1);
    auto x = input.to(compute_type(input));
    // Each rank's per-channel mean and biased variance (two-pass, exact for any offset), then
    // Chan's combination over the ranks: no E[x^2] - E[x]^2 cancellation when the mean is large
    // against the spread.
    const double local_count = static_cast<double>(input.numel() / std::max<int64_t>(channels, 1));
    auto [local_var, local_mean] = torch::var_mean(x, dims, /*unbiased=*/false);
    auto local = torch::cat({local_mean, local_var, torch::full({1}, local_count, x.options())});
    std::vector<at::Tensor> gathered;
    for (int r = 0; r < group->size(); ++r) gathered.push_back(torch::empty_like(local));
    group->allgather(gathered, local)->wait();
    auto all = torch::stack(gathered);                       // (world, 2C + 1)
    auto counts = all.narrow(1, 2 * channels, 1);            // (world, 1)
    auto count = counts.sum();
    SHOAL_CHECK_T(InvalidArgument, count.item<double>() > 0,
                  "SyncBatchNorm: the global batch is empty");
    auto means = all.narrow(1, 0, channels), vars = all.narrow(1, channels, channels);
    auto mean = (means * counts).sum(0) / count;
    auto deviation = means - mean.unsqueeze(0);
    auto var = ((vars + deviation * deviation) * counts).sum(0) / count;
    auto invstd = torch::rsqrt(var + eps);
    auto out = (x - per_channel(mean, x)) * per_channel(invstd, x);
    if (weight.defined()) {
      out = out * per_channel(weight.to(x.scalar_type()), x) +
            per_channel(bias.to(x.scalar_type()), x);
    }
    ctx->save_for_backward({input, weight, mean, invstd});
    ctx->saved_data["group"] = group_address;
    ctx->saved_data["count"] = count.item<double>();
    ctx->mark_non_differentiable({mean, var});
    return {out.to(input.scalar_type()), mean, var, count.reshape({1})};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    auto input = saved[0].to(compute_type(saved[0]));
    auto weight = saved[1], mean = saved[2], invstd = saved[3];
    auto* group = reinterpret_cast<comm::ProcessGroup*>(ctx->saved_data["group"].toInt());
    const double count = ctx->saved_data["count"].toDouble();
    const auto dims = reduce_dims(input);
    const int64_t channels = input.size(1);
    auto dy = grads[0].to(input.scalar_type());
    auto xmu = input - per_channel(mean, input);
    auto sum_dy = dy.sum(dims);
    auto sum_dy_xmu = (dy * xmu).sum(dims);
    // Weight and bias gradients stay local: DDP averages them like any other gradient.
    at::Tensor grad_weight, grad_bias;
    if (weight.defined()) {
      grad_weight = (sum_dy_xmu * invstd).to(weight.scalar_type());
      grad_bias = sum_dy.to(weight.scalar_type());
    }
    auto global = torch::cat({sum_dy, sum_dy_xmu});
    group->allreduce(global)->wait();
    auto mean_dy = global.narrow(0, 0, channels) / count;
    auto mean_dy_xmu = global.narrow(0, channels, channels) / count;
    auto scale = weight.defined() ? invstd * weight.to(invstd.scalar_type()) : invstd;
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
  // As PyTorch: only training synchronises. In evaluation the running statistics are used, or,
  // without them (track_running_stats = false), this rank's own batch statistics.
  if (!is_training() || group->size() == 1) {
    const bool use_batch_stats = is_training() || !options.track_running_stats();
    const double momentum = options.momentum().value_or(0.0);
    if (is_training() && options.track_running_stats()) {
      torch::NoGradGuard no_grad;
      num_batches_tracked += 1;
    }
    const double factor = options.momentum().has_value() || !num_batches_tracked.defined()
                              ? momentum
                              : 1.0 / num_batches_tracked.item<double>();
    return torch::batch_norm(input, weight, bias, running_mean, running_var, use_batch_stats,
                             factor, options.eps(), false);
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
    running_mean.mul_(1 - momentum).add_(results[1].to(running_mean.scalar_type()), momentum);
    running_var.mul_(1 - momentum)
        .add_((results[2] * (n / std::max(n - 1, 1.0))).to(running_var.scalar_type()), momentum);
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

// A SyncBatchNorm for `module` when it is a BatchNorm1d/2d/3d, else null.
std::shared_ptr<SyncBatchNormImpl> convert_one(torch::nn::Module& module,
                                               const std::shared_ptr<comm::ProcessGroup>& group) {
  if (auto* bn = module.as<torch::nn::BatchNorm1dImpl>()) return from_batch_norm(*bn, group).ptr();
  if (auto* bn = module.as<torch::nn::BatchNorm2dImpl>()) return from_batch_norm(*bn, group).ptr();
  if (auto* bn = module.as<torch::nn::BatchNorm3dImpl>()) return from_batch_norm(*bn, group).ptr();
  return nullptr;
}

// Replaces, inside `module` (a container), its children by `replacements` (name -> module).
// Sequential and ModuleList are rebuilt and assigned in place, so every holder of the container
// (a parent's typed member too) sees the new layers; ModuleDict replaces entries itself.
using Replacements = std::map<std::string, std::shared_ptr<SyncBatchNormImpl>>;

void replace_children(torch::nn::Module& module, const std::string& path,
                      const Replacements& replacements) {
  if (auto* seq = module.as<torch::nn::SequentialImpl>()) {
    auto names = seq->named_children().keys();
    torch::nn::Sequential rebuilt;
    size_t i = 0;
    for (auto& item : *seq) {
      const std::string& name = names[i++];
      auto found = replacements.find(name);
      if (found != replacements.end()) {
        rebuilt->push_back(std::string(name), torch::nn::AnyModule(SyncBatchNorm(found->second)));
      } else {
        rebuilt->push_back(std::string(name), item);
      }
    }
    rebuilt->train(seq->is_training());
    *seq = *rebuilt;
    return;
  }
  if (auto* list = module.as<torch::nn::ModuleListImpl>()) {
    torch::nn::ModuleList rebuilt;
    for (size_t i = 0; i < list->size(); ++i) {
      auto found = replacements.find(std::to_string(i));
      rebuilt->push_back(found != replacements.end()
                             ? std::static_pointer_cast<torch::nn::Module>(found->second)
                             : list->ptr(i));
    }
    rebuilt->train(list->is_training());
    *list = *rebuilt;
    return;
  }
  if (auto* dict = module.as<torch::nn::ModuleDictImpl>()) {
    std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> entries;
    for (const auto& [name, sync] : replacements) entries.emplace_back(name, sync);
    dict->update(entries);  // replaces the entries of the same names
    return;
  }
  const std::string& first = replacements.begin()->first;
  SHOAL_THROW(InvalidArgument, "convert_sync_batchnorm: '",
              path.empty() ? first : path + "." + first,
              "' is a BatchNorm held in a typed member of the custom module '", module.name(),
              "', which C++ cannot swap from outside; declare that layer as "
              "shoal::parallel::SyncBatchNorm, or hold it in a torch::nn::Sequential, ModuleList "
              "or ModuleDict (anywhere in the tree)");
}

void convert_children(torch::nn::Module& module, const std::string& path,
                      const std::shared_ptr<comm::ProcessGroup>& group) {
  Replacements replacements;
  for (const auto& child : module.named_children()) {
    if (auto sync = convert_one(*child.value(), group)) {
      sync->train(child.value()->is_training());
      replacements.emplace(child.key(), std::move(sync));
    } else {
      const std::string child_path = path.empty() ? child.key() : path + "." + child.key();
      convert_children(*child.value(), child_path, group);
    }
  }
  if (!replacements.empty()) replace_children(module, path, replacements);
}

}  // namespace

std::shared_ptr<torch::nn::Module> convert_sync_batchnorm(std::shared_ptr<torch::nn::Module> module,
                                                          std::shared_ptr<comm::ProcessGroup> group) {
  SHOAL_CHECK_T(InvalidArgument, module != nullptr, "convert_sync_batchnorm: the module is null");
  SHOAL_CHECK_T(InvalidArgument, group != nullptr,
                "convert_sync_batchnorm: the process group is null");
  if (auto sync = convert_one(*module, group)) {
    sync->train(module->is_training());
    return sync;
  }
  convert_children(*module, "", group);
  return module;
}

}  // namespace shoal::parallel
