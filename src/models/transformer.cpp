#include "shoal/models/transformer.h"

#include <torch/nn/functional/activation.h>

#include <cmath>

#include "shoal/error.h"

namespace shoal::models {
namespace {

constexpr int64_t kDim = 64;
constexpr int64_t kHeads = 4;
constexpr int64_t kHidden = 256;
constexpr int kBlocks = 4;

torch::nn::LayerNorm layer_norm(int64_t dim) {
  return torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim}));
}

}  // namespace

TransformerBlock::TransformerBlock(int64_t dim, int64_t heads, int64_t hidden) : heads_(heads) {
  ln1 = register_module("ln1", layer_norm(dim));
  qkv = register_module("qkv", torch::nn::Linear(dim, 3 * dim));
  proj = register_module("proj", torch::nn::Linear(dim, dim));
  ln2 = register_module("ln2", layer_norm(dim));
  fc1 = register_module("fc1", torch::nn::Linear(dim, hidden));
  fc2 = register_module("fc2", torch::nn::Linear(hidden, dim));
}

at::Tensor TransformerBlock::forward(const at::Tensor& x) {
  const int64_t batch = x.size(0), tokens = x.size(1), dim = x.size(2);
  const int64_t head_dim = dim / heads_;
  // [B,T,3D] -> 3 x [B,H,T,D/H]
  auto parts = qkv->forward(ln1->forward(x)).view({batch, tokens, 3, heads_, head_dim}).permute({2, 0, 3, 1, 4});
  const at::Tensor q = parts[0], k = parts[1], v = parts[2];
  const at::Tensor weights =
      torch::softmax(torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(head_dim)), -1);
  const at::Tensor attended = torch::matmul(weights, v).transpose(1, 2).reshape({batch, tokens, dim});
  at::Tensor y = x + proj->forward(attended);
  return y + fc2->forward(torch::gelu(fc1->forward(ln2->forward(y))));
}

Transformer::Transformer(const InputShape& shape) {
  SHOAL_CHECK_T(InvalidArgument, shape.channels >= 1 && shape.height >= 1 && shape.width >= 1 &&
                                     shape.num_classes >= 1,
                "the transformer model needs samples [C,H,W] with C, H, W >= 1 and a class");
  input_shape_ = shape;
  // One token per image row, its pixels of every channel as the token's features.
  embed = register_module("embed", torch::nn::Linear(shape.channels * shape.width, kDim));
  pos = register_module("pos", torch::nn::Embedding(shape.height, kDim));
  blocks = register_module("blocks", torch::nn::ModuleList());
  for (int i = 0; i < kBlocks; ++i) blocks->push_back(std::make_shared<TransformerBlock>(kDim, kHeads, kHidden));
  ln_f = register_module("ln_f", layer_norm(kDim));
  head = register_module("head", torch::nn::Linear(kDim, shape.num_classes));
}

at::Tensor Transformer::forward(at::Tensor input) {
  const InputShape& shape = input_shape_;
  // [B,C,H,W] -> [B,H,C*W]: rows as tokens.
  const at::Tensor rows = input.reshape({input.size(0), shape.channels, shape.height, shape.width})
                              .permute({0, 2, 1, 3})
                              .reshape({input.size(0), shape.height, shape.channels * shape.width});
  at::Tensor x = embed->forward(rows) + pos->weight;
  for (const auto& block : *blocks) x = block->as<TransformerBlock>()->forward(x);
  return head->forward(ln_f->forward(x).mean(1));
}

}  // namespace shoal::models
