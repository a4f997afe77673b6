#include "shoal/models/transformer.h"

#include <torch/nn/functional/activation.h>
#include <torch/utils.h>

#include <cmath>

#include "shoal/comm/process_group.h"
#include "shoal/error.h"
#include "shoal/parallel/tensor_parallel.h"

namespace shoal::models {
namespace {

constexpr int64_t kDim = 64;
constexpr int64_t kHeads = 4;
constexpr int64_t kHidden = 256;
constexpr int kBlocks = 4;
constexpr size_t kBlockQkv = 0, kBlockProj = 1, kBlockFc1 = 2, kBlockFc2 = 3;  // hookable layers

torch::nn::LayerNorm layer_norm(int64_t dim) {
  return torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim}));
}

}  // namespace

TransformerBlock::TransformerBlock(int64_t dim, int64_t heads, int64_t hidden)
    : LayerForwardHooks({"qkv", "proj", "fc1", "fc2"}), head_dim_(dim / heads) {
  ln1 = register_module("ln1", layer_norm(dim));
  qkv = register_module("qkv", torch::nn::Linear(dim, 3 * dim));
  proj = register_module("proj", torch::nn::Linear(dim, dim));
  ln2 = register_module("ln2", layer_norm(dim));
  fc1 = register_module("fc1", torch::nn::Linear(dim, hidden));
  fc2 = register_module("fc2", torch::nn::Linear(hidden, dim));
}

at::Tensor TransformerBlock::forward(const at::Tensor& x) {
  const int64_t batch = x.size(0), tokens = x.size(1);
  const auto linear = [this](size_t index, torch::nn::Linear& layer, const at::Tensor& in) {
    return call_layer(index, *layer, in, [&](const at::Tensor& input) { return layer->forward(input); });
  };
  const at::Tensor qkv_all = linear(kBlockQkv, qkv, ln1->forward(x));
  // [B,T,3C'] -> 3 x [B,H',T,D/H]; C' = H' * D/H (H' < heads when qkv is split by heads).
  const int64_t channels = qkv_all.size(2) / 3;
  auto parts = qkv_all.view({batch, tokens, 3, channels / head_dim_, head_dim_}).permute({2, 0, 3, 1, 4});
  const at::Tensor q = parts[0], k = parts[1], v = parts[2];
  const at::Tensor weights =
      torch::softmax(torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(head_dim_)), -1);
  const at::Tensor attended = torch::matmul(weights, v).transpose(1, 2).reshape({batch, tokens, channels});
  at::Tensor y = x + linear(kBlockProj, proj, attended);
  return y + linear(kBlockFc2, fc2, torch::gelu(linear(kBlockFc1, fc1, ln2->forward(y))));
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

std::shared_ptr<Model> Transformer::copy() const {
  auto copy = std::make_shared<Transformer>(input_shape_);
  torch::NoGradGuard no_grad;
  const auto parameters = named_parameters();
  for (auto& item : copy->named_parameters()) item.value().copy_(parameters[item.key()]);
  return copy;
}

parallel::TensorParallelLayout Transformer::parallelize(std::shared_ptr<comm::ProcessGroup> tp) {
  SHOAL_CHECK_T(InvalidArgument, tp != nullptr,
                "Transformer::parallelize: the tensor-parallel group is null (this rank is not in it)");
  const int64_t degree = tp->size();
  SHOAL_CHECK_T(InvalidArgument, kHeads % degree == 0 && kHidden % degree == 0,
                "the tensor-parallel degree tp=", degree, " does not divide the transformer's ",
                kHeads, " heads and ", kHidden, " feed-forward width; choose tp 1, 2 or 4");
  return parallel::parallelize_module(*this, std::move(tp),
                                      {{"blocks.*.qkv", parallel::ColwiseParallel{3}},
                                       {"blocks.*.proj", parallel::RowwiseParallel{}},
                                       {"blocks.*.fc1", parallel::ColwiseParallel{}},
                                       {"blocks.*.fc2", parallel::RowwiseParallel{}}});
}

}  // namespace shoal::models
