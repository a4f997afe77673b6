#include "shoal/data/token_block_dataset.h"

#include <ATen/ATen.h>

#include "shoal/error.h"

namespace shoal::data {

int64_t TokenBlockDataset::block_count(int64_t num_tokens, int64_t block_size) {
  return num_tokens > block_size ? (num_tokens - 1) / block_size : 0;
}

TokenBlockDataset::TokenBlockDataset(std::shared_ptr<const TokenFile> tokens, int64_t block_size)
    : tokens_(std::move(tokens)), block_size_(block_size) {
  SHOAL_CHECK_T(InvalidArgument, tokens_ != nullptr, "TokenBlockDataset: no token file");
  SHOAL_CHECK_T(InvalidArgument, block_size_ >= 1, "TokenBlockDataset: the block size is ",
                block_size_, "; it must be at least 1");
  num_blocks_ = block_count(tokens_->size(), block_size_);
  SHOAL_CHECK_T(DataError, num_blocks_ > 0, "token file ", tokens_->path(), " has ",
                tokens_->size(), " tokens, fewer than one block of ", block_size_, " + 1");
}

Batch TokenBlockDataset::get_batch(const at::Tensor& indices) const {
  const at::Tensor blocks = indices.to(at::kLong).contiguous();
  const int64_t* block = blocks.data_ptr<int64_t>();
  const int64_t count = blocks.numel();
  const int64_t span = block_size_ + 1;
  for (int64_t i = 0; i < count; ++i) {
    SHOAL_CHECK_T(InvalidArgument, block[i] >= 0 && block[i] < num_blocks_, "token file ",
                  tokens_->path(), ": block ", block[i], " is outside [0, ", num_blocks_, ")");
  }
  // Every block's read is started before the first is copied: one batch's faults overlap
  // instead of waiting for the disk one block at a time (what a cold page cache costs).
  for (int64_t i = 0; i < count; ++i) tokens_->prefetch(block[i] * block_size_, span);
  at::Tensor rows = at::empty({count, span}, at::kLong);
  int64_t* out = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i) tokens_->read_into(block[i] * block_size_, span, out + i * span);
  return {rows.narrow(1, 0, block_size_).contiguous(), rows.narrow(1, 1, block_size_).contiguous()};
}

}  // namespace shoal::data
