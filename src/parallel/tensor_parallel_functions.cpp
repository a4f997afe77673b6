// The autograd functions of tensor parallelism (Megatron's f, g, the gather of a split output and
// the vocabulary-parallel cross-entropy).
#include <torch/autograd.h>

#include "shoal/comm/process_group.h"
#include "shoal/error.h"
#include "shoal/parallel/tensor_parallel.h"
#include "parallel/tensor_parallel_regions.h"

namespace shoal::parallel {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

/// Carries the group through an autograd context (saved_data holds IValues only), keeping it
/// alive for as long as the graph that needs it in backward.
struct GroupCapsule : torch::CustomClassHolder {
  explicit GroupCapsule(std::shared_ptr<comm::ProcessGroup> g) : group(std::move(g)) {}
  std::shared_ptr<comm::ProcessGroup> group;
};

void save_group(AutogradContext* ctx, std::shared_ptr<comm::ProcessGroup> group) {
  ctx->saved_data["group"] =
      c10::IValue::make_capsule(c10::make_intrusive<GroupCapsule>(std::move(group)));
}

comm::ProcessGroup& saved_group(AutogradContext* ctx) {
  auto capsule = ctx->saved_data["group"].toCapsule();
  return *static_cast<GroupCapsule*>(capsule.get())->group;
}

/// `tensor` summed (or reduced by `op`) over `group`, as a new contiguous tensor.
at::Tensor allreduced(const at::Tensor& tensor, comm::ProcessGroup& group,
                      comm::ReduceOp op = comm::ReduceOp::kSum) {
  at::Tensor out = tensor.contiguous().clone();
  comm::AllreduceOptions options;
  options.op = op;
  options.async_op = false;
  group.allreduce(out, options)->wait();
  return out;
}

/// `tensor` summed over `group` in place, when it is contiguous and `in_place`; else a sum in a
/// new tensor.
at::Tensor summed(const at::Tensor& tensor, comm::ProcessGroup& group, bool in_place) {
  if (!in_place || !tensor.is_contiguous()) {
    return allreduced(tensor, group);
  }
  at::Tensor out = tensor;
  comm::AllreduceOptions options;
  options.async_op = false;
  group.allreduce(out, options)->wait();
  return out;
}

class CopyToRegion : public torch::autograd::Function<CopyToRegion> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input,
                            std::shared_ptr<comm::ProcessGroup> group) {
    save_group(ctx, std::move(group));
    return input.view_as(input);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {allreduced(grads[0], saved_group(ctx)), at::Tensor()};
  }
};

/// A column-split Linear with Megatron's f folded in. Backward starts the sum of the input's
/// gradient over the group (on the group's worker thread) and computes the weight's and the
/// bias's gradients while it runs: a rank that reaches the collective before its peers computes
/// instead of waiting. The input's gradient is a fresh tensor, summed in place.
class ColumnParallelLinear : public torch::autograd::Function<ColumnParallelLinear> {
 public:
  // Without a bias: autograd cannot take an undefined tensor as an input.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input,
                            const at::Tensor& weight, std::shared_ptr<comm::ProcessGroup> group) {
    return forward(ctx, input, weight, at::Tensor(), std::move(group));
  }
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input,
                            const at::Tensor& weight, const at::Tensor& bias,
                            std::shared_ptr<comm::ProcessGroup> group) {
    ctx->save_for_backward({input, weight});
    ctx->saved_data["bias"] = bias.defined();
    save_group(ctx, std::move(group));
    return at::linear(input, weight, bias);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &input = saved[0], &weight = saved[1];
    const bool bias = ctx->saved_data["bias"].toBool();
    const at::Tensor grad = grads[0].reshape({-1, grads[0].size(-1)});
    variable_list out(bias ? 4 : 3);
    std::shared_ptr<comm::Work> sum;
    if (ctx->needs_input_grad(0)) {
      out[0] = at::mm(grad, weight).view(input.sizes());
      comm::AllreduceOptions options;
      options.async_op = true;
      sum = saved_group(ctx).allreduce(out[0], options);
    }
    if (ctx->needs_input_grad(1)) out[1] = at::mm(grad.t(), input.reshape({-1, input.size(-1)}));
    if (bias && ctx->needs_input_grad(2)) out[2] = grad.sum(0);
    if (sum) sum->wait();
    return out;
  }
};

class ReduceFromRegion : public torch::autograd::Function<ReduceFromRegion> {
 public:
  static at::Tensor forward(AutogradContext*, const at::Tensor& input,
                            std::shared_ptr<comm::ProcessGroup> group, bool in_place) {
    return summed(input, *group, in_place);
  }
  static variable_list backward(AutogradContext*, variable_list grads) {
    return {grads[0], at::Tensor(), at::Tensor()};
  }
};

class GatherFromRegion : public torch::autograd::Function<GatherFromRegion> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input,
                            std::shared_ptr<comm::ProcessGroup> group) {
    std::vector<at::Tensor> pieces;
    for (int r = 0; r < group->size(); ++r) pieces.push_back(at::empty_like(input));
    comm::AllgatherOptions options;
    options.async_op = false;
    group->allgather(pieces, input.contiguous(), options)->wait();
    save_group(ctx, std::move(group));
    return at::cat(pieces, -1);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    comm::ProcessGroup& group = saved_group(ctx);
    return {grads[0].chunk(group.size(), -1)[group.rank()].contiguous(), at::Tensor()};
  }
};

/// Every rank's `input` [B, T/tp, ...] concatenated along the sequence (dimension 1), rank order.
at::Tensor gathered_sequence(const at::Tensor& input, comm::ProcessGroup& group) {
  std::vector<at::Tensor> pieces;
  for (int r = 0; r < group.size(); ++r) pieces.push_back(at::empty(input.sizes(), input.options()));
  comm::AllgatherOptions options;
  options.async_op = false;
  group.allgather(pieces, input.contiguous(), options)->wait();
  return at::cat(pieces, 1);
}

/// `input` [B, T, ...] summed over the group, this rank's T/tp positions of it kept.
at::Tensor scattered_sequence(const at::Tensor& input, comm::ProcessGroup& group) {
  SHOAL_CHECK_T(InvalidArgument, input.dim() >= 2 && input.size(1) % group.size() == 0,
                "sequence parallelism: the sequence of ", input.sizes(), " (dimension 1) does not "
                "split into ", group.size(), " equal pieces; use sequences whose length the "
                "tensor-parallel degree divides");
  std::vector<at::Tensor> pieces;
  for (const at::Tensor& piece : input.chunk(group.size(), 1)) pieces.push_back(piece.contiguous());
  at::Tensor out = at::empty_like(pieces[0]);
  comm::ReduceScatterOptions options;
  options.async_op = false;
  group.reduce_scatter(out, pieces, options)->wait();
  return out;
}

/// Sequence parallelism's all-gather before a column-split layer: forward all-gathers the
/// sequence shards, backward reduce-scatters the gradient (Megatron's
/// gather_from_sequence_parallel_region).
class GatherSequence : public torch::autograd::Function<GatherSequence> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input,
                            std::shared_ptr<comm::ProcessGroup> group) {
    at::Tensor out = gathered_sequence(input, *group);
    save_group(ctx, std::move(group));
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {scattered_sequence(grads[0], saved_group(ctx)), at::Tensor()};
  }
};

/// Sequence parallelism's reduce-scatter after a row-split layer: forward sums the partial
/// outputs and keeps this rank's sequence shard, backward all-gathers the gradient (Megatron's
/// reduce_scatter_to_sequence_parallel_region).
class ScatterSequence : public torch::autograd::Function<ScatterSequence> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input,
                            std::shared_ptr<comm::ProcessGroup> group) {
    at::Tensor out = scattered_sequence(input, *group);
    save_group(ctx, std::move(group));
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {gathered_sequence(grads[0], saved_group(ctx)), at::Tensor()};
  }
};

/// Every rank's `stats` [k, N], stacked in rank order: [tp, k, N].
at::Tensor gathered_rows(const at::Tensor& stats, comm::ProcessGroup& group) {
  std::vector<at::Tensor> pieces;
  for (int r = 0; r < group.size(); ++r) pieces.push_back(at::empty_like(stats));
  comm::AllgatherOptions options;
  options.async_op = false;
  group.allgather(pieces, stats.contiguous(), options)->wait();
  return at::stack(pieces);
}

/// Per-row losses of logits split over the vocabulary (Megatron's _VocabParallelCrossEntropy),
/// with one collective: each rank's per-row log-sum-exp of its columns and its target logit (zero
/// where the target is another rank's) are all-gathered; the row's log-sum-exp is the
/// log-sum-exp of the ranks' and its target logit their sum (one rank's is not zero).
class VocabParallelCrossEntropy : public torch::autograd::Function<VocabParallelCrossEntropy> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& local,
                            const at::Tensor& targets, std::shared_ptr<comm::ProcessGroup> group) {
    const int64_t width = local.size(1);
    const int64_t first = group->rank() * width;
    const at::Tensor mine = (targets >= first) & (targets < first + width);
    const at::Tensor column = (targets - first).masked_fill(~mine, 0).unsqueeze(1);
    const at::Tensor picked = local.gather(1, column).squeeze(1).masked_fill(~mine, 0);
    const at::Tensor all = gathered_rows(at::stack({at::logsumexp(local, 1), picked}), *group);
    const at::Tensor log_sum_exp = at::logsumexp(all.select(1, 0), 0);
    const at::Tensor valid = targets != -1;
    ctx->save_for_backward({local, log_sum_exp, column, mine, valid});
    return (log_sum_exp - all.select(1, 1).sum(0)).masked_fill(~valid, 0);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &local = saved[0], &log_sum_exp = saved[1];
    const at::Tensor &column = saved[2], &mine = saved[3], &valid = saved[4];
    // d loss_i / d logit_ij = softmax_ij - [j is target_i], zero for ignored rows; the softmax
    // is recomputed from the logits rather than kept from forward (one [N, V/tp] tensor less
    // between the passes).
    at::Tensor grad = (local - log_sum_exp.unsqueeze(1)).exp_();
    grad.scatter_add_(1, column, -mine.to(grad.scalar_type()).unsqueeze(1));
    grad.mul_((grads[0] * valid.to(grad.scalar_type())).unsqueeze(1));
    return {grad, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor copy_to_tensor_parallel_region(const at::Tensor& input,
                                          std::shared_ptr<comm::ProcessGroup> group) {
  return CopyToRegion::apply(input, std::move(group));
}

at::Tensor column_parallel_linear(const at::Tensor& input, const at::Tensor& weight,
                                  const at::Tensor& bias,
                                  std::shared_ptr<comm::ProcessGroup> group) {
  if (!bias.defined()) return ColumnParallelLinear::apply(input, weight, std::move(group));
  return ColumnParallelLinear::apply(input, weight, bias, std::move(group));
}

at::Tensor reduce_from_tensor_parallel_region(const at::Tensor& input,
                                              std::shared_ptr<comm::ProcessGroup> group) {
  return ReduceFromRegion::apply(input, std::move(group), false);
}

at::Tensor reduce_layer_output(const at::Tensor& output,
                               std::shared_ptr<comm::ProcessGroup> group) {
  return ReduceFromRegion::apply(output, std::move(group), true);
}

at::Tensor gather_from_tensor_parallel_region(const at::Tensor& input,
                                              std::shared_ptr<comm::ProcessGroup> group) {
  return GatherFromRegion::apply(input, std::move(group));
}

at::Tensor gather_from_sequence_parallel_region(const at::Tensor& input,
                                                std::shared_ptr<comm::ProcessGroup> group) {
  return GatherSequence::apply(input, std::move(group));
}

at::Tensor reduce_scatter_to_sequence_parallel_region(const at::Tensor& input,
                                                      std::shared_ptr<comm::ProcessGroup> group) {
  return ScatterSequence::apply(input, std::move(group));
}

at::Tensor vocab_parallel_cross_entropy(const at::Tensor& local, const at::Tensor& targets,
                                        std::shared_ptr<comm::ProcessGroup> group) {
  SHOAL_CHECK_T(InvalidArgument,
                local.dim() == 2 && targets.dim() == 1 && targets.size(0) == local.size(0),
                "vocab_parallel_cross_entropy takes logits [N, V/tp] and targets [N], got ",
                local.sizes(), " and ", targets.sizes());
  const at::Tensor ids = targets.to(at::kLong);
  const at::Tensor losses = VocabParallelCrossEntropy::apply(local, ids, std::move(group));
  // The mean over the targets that are not ignored, as cross_entropy(ignore_index=-1).
  return losses.sum() / (ids != -1).sum().to(losses.scalar_type());
}

}  // namespace shoal::parallel
