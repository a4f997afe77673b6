// Tensor parallelism: one layer's weights split across the ranks of a TP group (Megatron-LM's
// column- and row-parallel layers), the C++ counterpart of torch.distributed.tensor.parallel.
//
//   auto mesh = shoal::comm::DeviceMesh(world, {{"dp", 2}, {"tp", 2}});
//   auto layout = shoal::parallel::parallelize_module(*gpt, mesh.get_group("tp"), {
//       {"transformer.h.*.attn.c_attn", ColwiseParallel{3}},   // q, k, v: each split by heads
//       {"transformer.h.*.attn.c_proj", RowwiseParallel{}},
//       {"transformer.h.*.mlp.c_fc", ColwiseParallel{}},
//       {"transformer.h.*.mlp.c_proj", RowwiseParallel{}}});
//   // or parallelize_gpt(*gpt, tp_group), which adds the vocabulary-parallel embedding and loss
//
// The styles, as PyTorch's (and Megatron's f and g conjugate functions, which they insert):
//   ColwiseParallel  a Linear's output features (weight rows, bias) are split: rank r holds rows
//                    [r*out/tp, (r+1)*out/tp). The input is whole on every rank (copied into the
//                    TP region: identity forward, allreduce of its gradient in backward); the
//                    output stays split along its last dimension (or is all-gathered:
//                    gather_output). fused_blocks > 1 splits each of that many equal row blocks
//                    (nanoGPT's c_attn holds q, k and v: each rank then holds whole heads of each).
//   RowwiseParallel  a Linear's input features (weight columns) are split; its input arrives
//                    split along the last dimension (a ColwiseParallel's output); the partial
//                    outputs are allreduced (identity backward) and the bias, whole on every
//                    rank, added once. On an Embedding: the vocabulary is split (rank r holds
//                    rows [r*V/tp, (r+1)*V/tp)); ids outside a rank's rows give zeros there, and
//                    the allreduce sums the one rank's row (PyTorch's RowwiseParallel on
//                    nn.Embedding; Megatron's VocabParallelEmbedding).
//   SequenceParallel Megatron-SP's (PyTorch's SequenceParallel): a LayerNorm runs on its input's
//                    sequence shard [B, T/tp, C], whole weights on every rank, their gradients
//                    summed over the group; on an Embedding given whole position ids [T], each
//                    rank looks up its own chunk of them.
// Sequence parallelism (gpt_tensor_parallel_plan(true)) keeps the activations between the split
// layers sharded along the sequence (dimension 1): a ColwiseParallel with sequence_sharded_input
// all-gathers its input along the sequence (backward: reduce-scatter), a RowwiseParallel with
// sequence_sharded_output reduce-scatters its partial outputs along it (backward: all-gather; its
// bias's gradient summed over the group) in place of the allreduce.
// Split sizes must divide evenly (no padding): a layer whose size the TP degree does not divide is
// refused with InvalidArgument, and so is a sequence it does not divide (sequence parallelism).
//
// LibTorch modules have no forward hooks, so a style replaces a layer's forward through the
// models::LayerForwardHooks of a module above it (the built-in GPT's modules have them); a layer
// with no such module above it is refused. A parameter shared by two layers (the GPT's tied
// wte/lm_head weight) is split once, and must be split the same way by both.
//
// Collectives (over the TP group, in forward and backward order, identical on every TP rank):
// every style's forward and backward communicate as described above; nothing else. Every TP rank
// must see the same input batch.
//
// Dropout (tensor_parallel_dropout, the rule of Megatron's RNG tracker and PyTorch's TP): inside
// the TP region (the attention probabilities of a rank's own heads) each TP rank draws its own
// masks; in the replicated region (the embedding and residual dropout) every TP rank of a replica
// draws the same masks, so the replicated activations stay equal; DP replicas draw different ones.
//
// Thread safety: parallelize_module mutates the module (call it before training, on one thread);
// the module then trains as usual, one thread per rank.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/ordered_dict.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace shoal::comm {
class DeviceMesh;
class ProcessGroup;
}  // namespace shoal::comm

namespace shoal::models {
class Gpt;
struct GptConfig;
struct DropoutGenerators;
}  // namespace shoal::models

namespace shoal::parallel {

/// Split a Linear's output features (see the file comment).
struct ColwiseParallel {
  /// The weight's rows are this many equal blocks, each split over the TP ranks.
  int64_t fused_blocks = 1;
  /// All-gather the output along its last dimension (PyTorch's output_layouts=Replicate()).
  bool gather_output = false;
  /// The input arrives sharded along the sequence (PyTorch's input_layouts=Shard(1)): all-gather
  /// it first.
  bool sequence_sharded_input = false;
};

/// Split a Linear's input features, or an Embedding's vocabulary (see the file comment).
struct RowwiseParallel {
  /// Reduce-scatter the output along the sequence (PyTorch's output_layouts=Shard(1)) instead
  /// of allreducing it.
  bool sequence_sharded_output = false;
};

/// Run a LayerNorm on the sequence shard, or look up an Embedding's chunk of whole position ids
/// (see the file comment).
struct SequenceParallel {};

using ParallelStyle = std::variant<ColwiseParallel, RowwiseParallel, SequenceParallel>;

/// Layer-name patterns and their styles, applied in order. Patterns are fnmatch's, as PyTorch's
/// ("transformer.h.*.mlp.c_fc" names every block's c_fc); a pattern that matches no layer, or a
/// layer two patterns match, is an InvalidArgument.
using TensorParallelPlan = std::vector<std::pair<std::string, ParallelStyle>>;

/// How a parameter is split: along `dim`, each of `fused_blocks` equal blocks in TP-size pieces.
struct ShardSpec {
  int64_t dim = 0;
  int64_t fused_blocks = 1;
};

/// What parallelize_module did to a module: which parameters are shards, and the group. It refers
/// to the module without owning it: use it only while the module lives.
class TensorParallelLayout {
 public:
  TensorParallelLayout(torch::nn::Module& module, std::shared_ptr<comm::ProcessGroup> group);
  /// Parameter name (every name of a shared one) -> how it is split.
  const std::map<std::string, ShardSpec>& sharded() const { return sharded_; }
  const std::shared_ptr<comm::ProcessGroup>& group() const { return group_; }
  /// The module's parameters and buffers under their names, the shards all-gathered back into
  /// whole tensors (new tensors, detached). A collective over the TP group: every TP rank calls it.
  torch::OrderedDict<std::string, at::Tensor> full_state_dict() const;
  /// The whole tensor of parameter `name` (one of sharded()) from every rank's `shard` of it, or
  /// of anything shaped and split like it (an optimizer's state of it). A collective over the TP
  /// group.
  at::Tensor gather(const std::string& name, const at::Tensor& shard) const;
  /// This rank's piece of `whole`, split as parameter `name` (one of sharded()) is: the inverse
  /// of gather, without communication (an optimizer's whole state of it, from a checkpoint).
  at::Tensor shard(const std::string& name, const at::Tensor& whole) const;
  /// Bytes of this rank's parameters in the split layers (shared parameters counted once).
  int64_t sharded_layer_bytes() const;

 private:
  friend TensorParallelLayout parallelize_module(torch::nn::Module&,
                                                 std::shared_ptr<comm::ProcessGroup>,
                                                 const TensorParallelPlan&);
  torch::nn::Module* module_;
  std::shared_ptr<comm::ProcessGroup> group_;
  std::map<std::string, ShardSpec> sharded_;
  std::vector<std::string> layers_;  ///< the layers the plan split
};

/// Splits `module`'s layers that `plan` names over `tp_group`'s ranks (PyTorch's
/// parallelize_module): every TP rank calls it with the same plan on a module with the same
/// (whole) parameters; afterwards each holds its shards. InvalidArgument for a layer of another
/// type than Linear or Embedding (RowwiseParallel), a size the TP degree does not divide, a
/// pattern that matches nothing, or a layer no LayerForwardHooks module above it can hook.
TensorParallelLayout parallelize_module(torch::nn::Module& module,
                                        std::shared_ptr<comm::ProcessGroup> tp_group,
                                        const TensorParallelPlan& plan);
/// The same over the mesh's dimension `dimension`.
TensorParallelLayout parallelize_module(torch::nn::Module& module, const comm::DeviceMesh& mesh,
                                        const TensorParallelPlan& plan,
                                        const std::string& dimension = "tp");

/// The built-in GPT's plan: attention c_attn colwise by heads and c_proj rowwise, MLP c_fc
/// colwise and c_proj rowwise, the token embedding vocabulary-parallel and the tied head colwise
/// (its logits split over the vocabulary). With `sequence_parallel`, also the LayerNorms and the
/// position embedding SequenceParallel, and the activations between the split layers sharded
/// along the sequence (T must then divide by tp).
TensorParallelPlan gpt_tensor_parallel_plan(bool sequence_parallel = false);
/// InvalidArgument, one line naming the size, unless `tp` divides the GPT's n_head, n_embd,
/// 4*n_embd and vocab_size (the vocabulary is not padded).
void check_gpt_tensor_parallel(const models::GptConfig& config, int64_t tp);
/// check_gpt_tensor_parallel, parallelize_module with gpt_tensor_parallel_plan(), and the GPT's
/// loss made vocabulary-parallel (vocab_parallel_cross_entropy: the logits are never gathered;
/// forward() still returns whole logits, gathered).
TensorParallelLayout parallelize_gpt(models::Gpt& gpt,
                                     std::shared_ptr<comm::ProcessGroup> tp_group,
                                     bool sequence_parallel = false);

/// The GPT's dropout generators (models::Gpt::set_dropout_generators) on the rank at `tp_rank` of
/// its TP group and `dp_rank` of the replicas, from the job's `seed`: `replicated` seeded alike on
/// every TP rank of a replica, `sharded` per TP rank, both per replica (see the file comment). The
/// same seed and ranks give the same masks, run after run.
/// With `sequence_parallel` the embedding and residual dropout act on each rank's own sequence
/// shard, so `replicated` too is seeded per TP rank (Megatron draws them from its TP generator).
models::DropoutGenerators tensor_parallel_dropout(uint64_t seed, int64_t tp_rank, int64_t dp_rank,
                                                  bool sequence_parallel = false);

/// Megatron's f: identity forward, allreduce (sum) of the gradient over `group` in backward.
at::Tensor copy_to_tensor_parallel_region(const at::Tensor& input,
                                          std::shared_ptr<comm::ProcessGroup> group);
/// Megatron's g: allreduce (sum) over `group` in forward, identity backward.
at::Tensor reduce_from_tensor_parallel_region(const at::Tensor& input,
                                              std::shared_ptr<comm::ProcessGroup> group);
/// All-gathers the ranks' `input`s along the last dimension (rank order); backward keeps this
/// rank's slice of the gradient.
at::Tensor gather_from_tensor_parallel_region(const at::Tensor& input,
                                              std::shared_ptr<comm::ProcessGroup> group);
/// Sequence parallelism's g before a column-split layer: all-gathers the ranks' `input`s
/// [B, T/tp, ...] along dimension 1 (rank order); backward reduce-scatters the gradient.
at::Tensor gather_from_sequence_parallel_region(const at::Tensor& input,
                                                std::shared_ptr<comm::ProcessGroup> group);
/// Sequence parallelism's f after a row-split layer: sums `input` [B, T, ...] over the group and
/// keeps this rank's T/tp positions of dimension 1; backward all-gathers the gradient.
at::Tensor reduce_scatter_to_sequence_parallel_region(const at::Tensor& input,
                                                      std::shared_ptr<comm::ProcessGroup> group);
/// Mean cross-entropy of logits split over the vocabulary: `local` [N, V/tp] is this rank's
/// columns [rank*V/tp, (rank+1)*V/tp) of the logits, targets [N] hold ids in [0, V) or -1
/// (ignored). Only two numbers per row cross the ranks, in one all-gather of 2N elements (no
/// collective in backward); the result and its gradient equal cross_entropy of the whole logits.
at::Tensor vocab_parallel_cross_entropy(const at::Tensor& local, const at::Tensor& targets,
                                        std::shared_ptr<comm::ProcessGroup> group);

}  // namespace shoal::parallel
