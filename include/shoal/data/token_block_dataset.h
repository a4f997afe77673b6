// TokenBlockDataset: a language model's samples from a TokenFile: block i is the tokens
// [i * block_size, i * block_size + block_size] (block_size + 1 of them), its input the first
// block_size and its target the last block_size (the input shifted by one), as nanoGPT's get_batch
// but at fixed, non-overlapping offsets, so that an epoch is a set of blocks each of which a
// sampler (ExactlyOnceSampler) can deal exactly once. The last token of block i is the first of
// block i + 1: every token is a target once. A file of n tokens has (n - 1) / block_size blocks;
// the tokens past the last whole block are not used.
//
//   auto tokens = std::make_shared<TokenFile>("train.bin", TokenFileOptions{});
//   TokenBlockDataset blocks(tokens, /*block_size=*/256);
//   ExactlyOnceSamplerOptions dealing;
//   dealing.seed = 1337;
//   ExactlyOnceSampler sampler(blocks.size(), rank, world_size, dealing);
//   sampler.set_epoch(epoch);
//   DataLoaderOptions loading;
//   loading.batch_size = 12;
//   DataLoader loader(blocks, sampler.indices(), loading);
//   while (auto batch = loader.next()) step(batch->data, batch->target);  // [12, 256] int64 each
//
// Thread safety: get_batch may be called concurrently (it only reads the file).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>

#include "shoal/data/batch_dataset.h"
#include "shoal/data/token_file.h"

namespace shoal::data {

class TokenBlockDataset : public BatchDataset {
 public:
  /// Throws InvalidArgument for block_size < 1 and DataError naming the file when it holds fewer
  /// than block_size + 1 tokens (no block at all).
  TokenBlockDataset(std::shared_ptr<const TokenFile> tokens, int64_t block_size);

  /// Number of blocks.
  int64_t size() const override { return num_blocks_; }
  /// Inputs [k, block_size] and targets [k, block_size], int64, contiguous, of the blocks at
  /// `indices` ([k], each in [0, size())). The blocks' pages are prefetched together first.
  Batch get_batch(const at::Tensor& indices) const override;
  /// Each block once per epoch: a stream too large to repeat blocks for padding.
  bool deal_exactly_once() const override { return true; }

  int64_t block_size() const { return block_size_; }
  const TokenFile& tokens() const { return *tokens_; }
  /// Blocks in a file of `num_tokens` tokens: (num_tokens - 1) / block_size, or 0.
  static int64_t block_count(int64_t num_tokens, int64_t block_size);

 private:
  std::shared_ptr<const TokenFile> tokens_;
  int64_t block_size_;
  int64_t num_blocks_;
};

}  // namespace shoal::data
