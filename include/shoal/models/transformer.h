// A small pre-norm transformer encoder over the rows of an image: the workload with many small
// parameters (4 blocks x 12 tensors + embeddings and head: 54 tensors, 0.2 M parameters, none
// over 33 K elements), where a data-parallel step's cost per parameter and per bucket (hooks,
// copies, launches) shows instead of its bandwidth.
//
//   x [B,1,28,28] -> 28 tokens of 28 pixels -> embed Linear(28,64) + pos Embedding(28,64)
//   4 x { x += proj(attention(qkv(ln1(x)))) (4 heads of 16); x += fc2(gelu(fc1(ln2(x)))) }
//   ln_f, mean over tokens, head Linear(64,10)
//
// Written from Linear/LayerNorm/Embedding rather than nn::TransformerEncoderLayer so that the
// Python twin (tests/models/pytorch_models.py) registers the same tensors in the same order under
// the same names, and both initialise them identically after manual_seed.
//
// Tensor parallelism (parallelize) splits each block Megatron's way: qkv by heads and fc1
// column-wise, proj and fc2 row-wise; the blocks call those layers through LayerForwardHooks, and
// the attention takes as many heads as its (possibly split) qkv yields.
//
// Thread safety: that of torch::nn::Module (see model.h).
#pragma once

#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/normalization.h>

#include "shoal/models/layer_forward_hooks.h"
#include "shoal/models/model.h"

namespace shoal::models {

/// One pre-norm encoder block: multi-head self-attention and a GELU feed-forward, each residual.
/// Hookable layers: qkv, proj, fc1, fc2.
class TransformerBlock : public torch::nn::Module, public LayerForwardHooks {
 public:
  TransformerBlock(int64_t dim, int64_t heads, int64_t hidden);
  /// [B,T,dim] -> [B,T,dim].
  at::Tensor forward(const at::Tensor& x);

  torch::nn::LayerNorm ln1{nullptr};
  torch::nn::Linear qkv{nullptr};
  torch::nn::Linear proj{nullptr};
  torch::nn::LayerNorm ln2{nullptr};
  torch::nn::Linear fc1{nullptr};
  torch::nn::Linear fc2{nullptr};

 private:
  int64_t head_dim_;
};

/// The encoder above: [B,C,H,W] -> H tokens of C x W features -> logits [B,num_classes]
/// (Fashion-MNIST's shape by default).
class Transformer : public Model {
 public:
  Transformer() : Transformer(InputShape{}) {}
  explicit Transformer(const InputShape& shape);
  at::Tensor forward(at::Tensor input) override;
  /// A transformer of this shape with a copy of these weights.
  std::shared_ptr<Model> copy() const override;
  /// Splits the blocks over `tp` (see the file comment); InvalidArgument unless tp divides the
  /// heads and the feed-forward width.
  parallel::TensorParallelLayout parallelize(std::shared_ptr<comm::ProcessGroup> tp) override;

  torch::nn::Linear embed{nullptr};
  torch::nn::Embedding pos{nullptr};
  torch::nn::ModuleList blocks;  // of TransformerBlock, named blocks.0 ... as nn.ModuleList
  torch::nn::LayerNorm ln_f{nullptr};
  torch::nn::Linear head{nullptr};
};

}  // namespace shoal::models
