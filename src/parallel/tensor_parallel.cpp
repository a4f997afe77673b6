#include "shoal/parallel/tensor_parallel.h"

#include <ATen/CPUGeneratorImpl.h>
#include <fnmatch.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/utils.h>

#include <algorithm>
#include <set>

#include "shoal/comm/device_mesh.h"
#include "shoal/comm/process_group.h"
#include "shoal/error.h"
#include "shoal/models/gpt.h"
#include "parallel/tensor_parallel_regions.h"

namespace shoal::parallel {
namespace {

using GroupPtr = std::shared_ptr<comm::ProcessGroup>;

/// Megatron's offset of the tensor-parallel dropout seed from the replicated one.
constexpr uint64_t kShardedSeedOffset = 2718;
/// Seeds of one replica from the next's: above twice kShardedSeedOffset plus any TP degree, so no two
/// generators of a job share a seed.
constexpr uint64_t kReplicaSeedStride = 1'000'003;

/// A layer the plan names, and the module above it whose forward hooks can replace its forward.
struct Target {
  std::string path;
  torch::nn::Module* layer = nullptr;
  models::LayerForwardHooks* owner = nullptr;
  std::string path_in_owner;
};

/// Where a module's parameter tensors went: a parameter split once (by TensorImpl) is not split
/// again when a second layer shares it (the GPT's tied weight), but must be split the same way.
using SplitTensors = std::map<const c10::TensorImpl*, ShardSpec>;

/// The module's own parameter `name`, or an undefined tensor.
at::Tensor own_parameter(torch::nn::Module& layer, const std::string& name) {
  const auto* found = layer.named_parameters(/*recurse=*/false).find(name);
  return found ? *found : at::Tensor();
}

/// This rank's piece of `whole` split as `spec` says: of each fused block, the rank's share.
at::Tensor piece_of(const at::Tensor& whole, const ShardSpec& spec, const comm::ProcessGroup& group) {
  std::vector<at::Tensor> mine;
  for (const at::Tensor& block : whole.chunk(spec.fused_blocks, spec.dim)) {
    mine.push_back(block.chunk(group.size(), spec.dim)[group.rank()]);
  }
  return at::cat(mine, spec.dim).contiguous();
}

/// Replaces `param`'s data by this rank's piece of it (see ShardSpec), in place, so every module
/// and name that holds it sees the shard.
void split_parameter(at::Tensor param, const ShardSpec& spec, const comm::ProcessGroup& group,
                     const std::string& name, SplitTensors& split) {
  if (!param.defined()) return;
  const auto known = split.find(param.unsafeGetTensorImpl());
  if (known != split.end()) {
    SHOAL_CHECK_T(InvalidArgument,
                  known->second.dim == spec.dim && known->second.fused_blocks == spec.fused_blocks,
                  "parallelize_module: ", name, " is shared with a layer split another way");
    return;
  }
  const int64_t pieces = spec.fused_blocks * group.size();
  SHOAL_CHECK_T(InvalidArgument, param.size(spec.dim) % pieces == 0, "parallelize_module: ", name,
                " has ", param.size(spec.dim), " rows/columns along dimension ", spec.dim,
                ", which do not split into ", pieces, " equal pieces (tensor-parallel degree ",
                group.size(), spec.fused_blocks > 1 ? " times the fused blocks" : "", ")");
  torch::NoGradGuard no_grad;
  param.set_data(piece_of(param, spec, group));
  param.mutable_grad() = at::Tensor();
  split.emplace(param.unsafeGetTensorImpl(), spec);
}

/// The module at `path` below `root` ("" is root itself), or null.
torch::nn::Module* module_at(
    torch::nn::Module& root,
    const torch::OrderedDict<std::string, std::shared_ptr<torch::nn::Module>>& modules,
    const std::string& path) {
  if (path.empty()) return &root;
  const auto* found = modules.find(path);
  return found ? found->get() : nullptr;
}

/// The nearest module above `path` that can hook the layer there; InvalidArgument when none can.
Target locate(torch::nn::Module& root,
              const torch::OrderedDict<std::string, std::shared_ptr<torch::nn::Module>>& modules,
              const std::string& path) {
  Target target;
  target.path = path;
  target.layer = modules[path].get();
  // Candidates from the innermost: "a.b" for "a.b.c", then "a", then the root.
  std::string above = path;
  while (true) {
    const size_t dot = above.rfind('.');
    above = dot == std::string::npos ? "" : above.substr(0, dot);
    auto* owner = dynamic_cast<models::LayerForwardHooks*>(module_at(root, modules, above));
    const std::string below = above.empty() ? path : path.substr(above.size() + 1);
    if (owner != nullptr) {
      const auto& layers = owner->hookable_layers();
      if (std::find(layers.begin(), layers.end(), below) != layers.end()) {
        target.owner = owner;
        target.path_in_owner = below;
        return target;
      }
    }
    if (above.empty()) break;
  }
  SHOAL_THROW(InvalidArgument, "parallelize_module: no module above ", path,
              " can replace its forward (LibTorch modules have no forward hooks; a module whose "
              "forward calls the layer through models::LayerForwardHooks can)");
}

void check_linear(torch::nn::Module& layer, const std::string& path) {
  const at::Tensor weight = own_parameter(layer, "weight");
  SHOAL_CHECK_T(InvalidArgument,
                weight.defined() && weight.dim() == 2 &&
                    dynamic_cast<torch::nn::EmbeddingImpl*>(&layer) == nullptr,
                "parallelize_module: ", path,
                " is not a Linear (a 2-D weight [out, in] and an optional bias)");
}

void apply_style(const Target& target, const ColwiseParallel& style, const GroupPtr& group,
                 SplitTensors& split) {
  check_linear(*target.layer, target.path);
  SHOAL_CHECK_T(InvalidArgument, style.fused_blocks >= 1, "parallelize_module: ", target.path,
                ": ColwiseParallel's fused_blocks must be at least 1");
  const ShardSpec rows{0, style.fused_blocks};
  const at::Tensor weight = own_parameter(*target.layer, "weight");
  const at::Tensor bias = own_parameter(*target.layer, "bias");
  split_parameter(weight, rows, *group, target.path + ".weight", split);
  split_parameter(bias, rows, *group, target.path + ".bias", split);
  const bool gather = style.gather_output, sequence = style.sequence_sharded_input;
  target.owner->set_layer_forward(target.path_in_owner, [weight, bias, group, gather, sequence](
                                                            torch::nn::Module&, const at::Tensor& x) {
    // The sequence's all-gather sums the input's gradient in backward, as f would.
    const at::Tensor out =
        sequence ? at::linear(gather_from_sequence_parallel_region(x, group), weight, bias)
                 : column_parallel_linear(x, weight, bias, group);
    return gather ? gather_from_tensor_parallel_region(out, group) : out;
  });
}

/// The sum of the ranks' partial `output`s: whole (allreduce), or this rank's sequence shard of
/// it (reduce-scatter).
at::Tensor reduce_partial(const at::Tensor& output, const GroupPtr& group, bool sequence) {
  return sequence ? reduce_scatter_to_sequence_parallel_region(output, group)
                  : reduce_layer_output(output, group);
}

void apply_rowwise_embedding(const Target& target, const RowwiseParallel& style,
                             const GroupPtr& group, SplitTensors& split) {
  const at::Tensor weight = own_parameter(*target.layer, "weight");
  split_parameter(weight, ShardSpec{0, 1}, *group, target.path + ".weight", split);
  const int64_t rows = weight.size(0);
  const int64_t first = group->rank() * rows;
  const bool sequence = style.sequence_sharded_output;
  auto forward = [weight, group, rows, first, sequence](torch::nn::Module&, const at::Tensor& ids) {
    const at::Tensor elsewhere = (ids < first) | (ids >= first + rows);
    at::Tensor local = at::embedding(weight, (ids - first).masked_fill(elsewhere, 0));
    return reduce_partial(local.masked_fill_(elsewhere.unsqueeze(-1), 0), group, sequence);
  };
  target.owner->set_layer_forward(target.path_in_owner, std::move(forward));
}

void apply_style(const Target& target, const RowwiseParallel& style, const GroupPtr& group,
                 SplitTensors& split) {
  if (dynamic_cast<torch::nn::EmbeddingImpl*>(target.layer) != nullptr) {
    apply_rowwise_embedding(target, style, group, split);
    return;
  }
  check_linear(*target.layer, target.path);
  const at::Tensor weight = own_parameter(*target.layer, "weight");
  const at::Tensor bias = own_parameter(*target.layer, "bias");
  split_parameter(weight, ShardSpec{1, 1}, *group, target.path + ".weight", split);
  const bool sequence = style.sequence_sharded_output;
  target.owner->set_layer_forward(
      target.path_in_owner, [weight, bias, group, sequence](torch::nn::Module&, const at::Tensor& x) {
        const at::Tensor sum = reduce_partial(at::linear(x, weight), group, sequence);
        if (!bias.defined()) return sum;
        // On a sequence shard each rank's bias gradient is its positions' part: summed (f).
        return sum + (sequence ? copy_to_tensor_parallel_region(bias, group) : bias);
      });
}

/// `param` whose gradient is summed over the group (f), or an undefined tensor.
at::Tensor summed_gradient(const at::Tensor& param, const GroupPtr& group) {
  return param.defined() ? copy_to_tensor_parallel_region(param, group) : param;
}

void apply_style(const Target& target, const SequenceParallel&, const GroupPtr& group,
                 SplitTensors&) {
  if (auto* norm = dynamic_cast<torch::nn::LayerNormImpl*>(target.layer)) {
    const std::vector<int64_t> shape = norm->options.normalized_shape();
    const double eps = norm->options.eps();
    const at::Tensor weight = norm->weight, bias = norm->bias;
    target.owner->set_layer_forward(
        target.path_in_owner, [shape, eps, weight, bias, group](torch::nn::Module&, const at::Tensor& x) {
          return at::layer_norm(x, shape, summed_gradient(weight, group),
                                summed_gradient(bias, group), eps);
        });
    return;
  }
  SHOAL_CHECK_T(InvalidArgument, dynamic_cast<torch::nn::EmbeddingImpl*>(target.layer) != nullptr,
                "parallelize_module: ", target.path,
                " is neither a LayerNorm nor an Embedding (SequenceParallel)");
  const at::Tensor weight = own_parameter(*target.layer, "weight");
  target.owner->set_layer_forward(
      target.path_in_owner, [weight, group](torch::nn::Module&, const at::Tensor& ids) {
        SHOAL_CHECK_T(InvalidArgument, ids.size(-1) % group->size() == 0,
                      "sequence parallelism: ", ids.size(-1), " positions do not split into ",
                      group->size(), " equal pieces; use sequences whose length tp divides");
        const at::Tensor mine = ids.chunk(group->size(), -1)[group->rank()];
        return at::embedding(summed_gradient(weight, group), mine);
      });
}

/// The layers `plan` names, each with its style; InvalidArgument for a pattern matching nothing
/// or a layer matched twice.
std::vector<std::pair<std::string, ParallelStyle>> match_plan(
    const torch::OrderedDict<std::string, std::shared_ptr<torch::nn::Module>>& modules,
    const TensorParallelPlan& plan) {
  std::vector<std::pair<std::string, ParallelStyle>> matched;
  std::set<std::string> seen;
  for (const auto& [pattern, style] : plan) {
    bool any = false;
    for (const auto& item : modules) {
      if (fnmatch(pattern.c_str(), item.key().c_str(), 0) != 0) continue;
      SHOAL_CHECK_T(InvalidArgument, seen.insert(item.key()).second,
                    "parallelize_module: ", item.key(),
                    " is matched by two patterns of the plan (the second: '", pattern, "')");
      matched.emplace_back(item.key(), style);
      any = true;
    }
    SHOAL_CHECK_T(InvalidArgument, any, "parallelize_module: the plan's pattern '", pattern,
                  "' matches no layer of the module");
  }
  return matched;
}

/// Every rank's `shard` put back together (the inverse of split_parameter).
at::Tensor gathered(const at::Tensor& shard, const ShardSpec& spec, comm::ProcessGroup& group) {
  std::vector<at::Tensor> pieces;
  for (int r = 0; r < group.size(); ++r) pieces.push_back(at::empty_like(shard));
  comm::AllgatherOptions options;
  options.async_op = false;
  group.allgather(pieces, shard.detach().contiguous(), options)->wait();
  std::vector<at::Tensor> blocks;
  for (int64_t b = 0; b < spec.fused_blocks; ++b) {
    for (const at::Tensor& piece : pieces) {
      blocks.push_back(piece.chunk(spec.fused_blocks, spec.dim)[b]);
    }
  }
  return at::cat(blocks, spec.dim);
}

}  // namespace

TensorParallelLayout::TensorParallelLayout(torch::nn::Module& module,
                                           std::shared_ptr<comm::ProcessGroup> group)
    : module_(&module), group_(std::move(group)) {}

torch::OrderedDict<std::string, at::Tensor> TensorParallelLayout::full_state_dict() const {
  torch::OrderedDict<std::string, at::Tensor> state;
  for (const auto& item : module_->named_parameters()) {
    const auto found = sharded_.find(item.key());
    state.insert(item.key(), found == sharded_.end()
                                 ? item.value().detach().clone()
                                 : gathered(item.value(), found->second, *group_));
  }
  for (const auto& item : module_->named_buffers()) {
    state.insert(item.key(), item.value().detach().clone());
  }
  return state;
}

at::Tensor TensorParallelLayout::gather(const std::string& name, const at::Tensor& shard) const {
  const auto found = sharded_.find(name);
  SHOAL_CHECK_T(InvalidArgument, found != sharded_.end(), "TensorParallelLayout::gather: ", name,
                " is not a split parameter");
  return gathered(shard, found->second, *group_);
}

at::Tensor TensorParallelLayout::shard(const std::string& name, const at::Tensor& whole) const {
  const auto found = sharded_.find(name);
  SHOAL_CHECK_T(InvalidArgument, found != sharded_.end(), "TensorParallelLayout::shard: ", name,
                " is not a split parameter");
  return piece_of(whole.detach(), found->second, *group_);
}

int64_t TensorParallelLayout::sharded_layer_bytes() const {
  std::set<const c10::TensorImpl*> counted;
  int64_t bytes = 0;
  const auto modules = module_->named_modules("", /*include_self=*/false);
  for (const std::string& path : layers_) {
    for (const auto& item : modules[path]->named_parameters(/*recurse=*/false)) {
      if (counted.insert(item.value().unsafeGetTensorImpl()).second) {
        bytes += item.value().numel() * static_cast<int64_t>(item.value().element_size());
      }
    }
  }
  return bytes;
}

TensorParallelLayout parallelize_module(torch::nn::Module& module, GroupPtr tp_group,
                                        const TensorParallelPlan& plan) {
  SHOAL_CHECK_T(InvalidArgument, tp_group != nullptr,
                "parallelize_module: the tensor-parallel group is null (this rank is not in it)");
  const auto modules = module.named_modules("", /*include_self=*/false);
  TensorParallelLayout layout(module, tp_group);
  SplitTensors split;
  for (const auto& [path, style] : match_plan(modules, plan)) {
    const Target target = locate(module, modules, path);
    std::visit([&](const auto& s) { apply_style(target, s, tp_group, split); }, style);
    if (!std::holds_alternative<SequenceParallel>(style)) layout.layers_.push_back(path);
  }
  for (const auto& item : module.named_parameters()) {
    const auto found = split.find(item.value().unsafeGetTensorImpl());
    if (found != split.end()) layout.sharded_.emplace(item.key(), found->second);
  }
  return layout;
}

TensorParallelLayout parallelize_module(torch::nn::Module& module, const comm::DeviceMesh& mesh,
                                        const TensorParallelPlan& plan,
                                        const std::string& dimension) {
  return parallelize_module(module, mesh.get_group(dimension), plan);
}

TensorParallelPlan gpt_tensor_parallel_plan(bool sequence_parallel) {
  const bool sp = sequence_parallel;
  TensorParallelPlan plan = {{"transformer.wte", RowwiseParallel{sp}},
                             {"lm_head", ColwiseParallel{1, false, sp}},
                             {"transformer.h.*.attn.c_attn", ColwiseParallel{3, false, sp}},
                             {"transformer.h.*.attn.c_proj", RowwiseParallel{sp}},
                             {"transformer.h.*.mlp.c_fc", ColwiseParallel{1, false, sp}},
                             {"transformer.h.*.mlp.c_proj", RowwiseParallel{sp}}};
  if (sp) {
    for (const char* layer : {"transformer.wpe", "transformer.h.*.ln_1", "transformer.h.*.ln_2",
                              "transformer.ln_f"}) {
      plan.emplace_back(layer, SequenceParallel{});
    }
  }
  return plan;
}

void check_gpt_tensor_parallel(const models::GptConfig& config, int64_t tp) {
  const std::pair<const char*, int64_t> sizes[] = {{"--n-head", config.n_head},
                                                   {"--n-embd", config.n_embd},
                                                   {"4 x --n-embd (the MLP)", 4 * config.n_embd},
                                                   {"--vocab-size", config.vocab_size}};
  for (const auto& [name, size] : sizes) {
    SHOAL_CHECK_T(InvalidArgument, tp >= 1 && size % tp == 0, "the tensor-parallel degree tp=", tp,
                  " does not divide ", name, " (", size,
                  "); choose a tp that divides the heads, the width and the vocabulary");
  }
}

TensorParallelLayout parallelize_gpt(models::Gpt& gpt, GroupPtr tp_group, bool sequence_parallel) {
  SHOAL_CHECK_T(InvalidArgument, tp_group != nullptr,
                "parallelize_gpt: the tensor-parallel group is null (this rank is not in it)");
  check_gpt_tensor_parallel(gpt.config(), tp_group->size());
  TensorParallelLayout layout =
      parallelize_module(gpt, tp_group, gpt_tensor_parallel_plan(sequence_parallel));
  models::ShardedLogits logits;
  logits.gather = [tp_group](const at::Tensor& local) {
    return gather_from_tensor_parallel_region(local, tp_group);
  };
  logits.cross_entropy = [tp_group](const at::Tensor& local, const at::Tensor& targets) {
    return vocab_parallel_cross_entropy(local, targets, tp_group);
  };
  gpt.set_sharded_logits(std::move(logits));
  return layout;
}

models::DropoutGenerators tensor_parallel_dropout(uint64_t seed, int64_t tp_rank,
                                                  int64_t dp_rank, bool sequence_parallel) {
  SHOAL_CHECK_T(InvalidArgument, tp_rank >= 0 && dp_rank >= 0,
                "tensor_parallel_dropout: ranks must be >= 0, got tp ", tp_rank, " and dp ", dp_rank);
  const uint64_t replica = seed + kReplicaSeedStride * static_cast<uint64_t>(dp_rank);
  models::DropoutGenerators generators;
  const uint64_t own = kShardedSeedOffset + static_cast<uint64_t>(tp_rank);
  generators.sharded = at::make_generator<at::CPUGeneratorImpl>(replica + own);
  // Sequence shards: a seed of the rank's own, away from its sharded one.
  generators.replicated =
      at::make_generator<at::CPUGeneratorImpl>(sequence_parallel ? replica + own + kShardedSeedOffset : replica);
  return generators;
}

}  // namespace shoal::parallel
