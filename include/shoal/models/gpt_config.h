// The sizes of the built-in GPT (models::Gpt), nanoGPT's GPTConfig: what `shoal train --model gpt`
// sets with --n-layer, --n-head, --n-embd, --block-size, --vocab-size and --dropout. Kept apart
// from gpt.h so that the trainer's options carry it without LibTorch's module headers.
//
// Thread safety: a plain value type.
#pragma once

#include <cstdint>

namespace shoal::models {

/// A GPT-2-style decoder's sizes. The defaults are a small byte-level model that trains on a CPU
/// in minutes (0.8 M parameters); GPT-2 small is n_layer 12, n_head 12, n_embd 768, block_size
/// 1024, vocab_size 50257.
struct GptConfig {
  /// Transformer blocks.
  int64_t n_layer = 4;
  /// Attention heads per block; divides n_embd.
  int64_t n_head = 4;
  /// Width of the residual stream (the embeddings).
  int64_t n_embd = 128;
  /// The longest sequence (the position embedding's rows).
  int64_t block_size = 128;
  /// Token ids are in [0, vocab_size); 256: bytes.
  int64_t vocab_size = 256;
  /// Dropout after the embeddings, on the attention weights and on each residual branch, in
  /// training only; in [0, 1).
  double dropout = 0;

  /// Throws InvalidArgument naming the first size that cannot work (as its --flag).
  void validate() const;
};

}  // namespace shoal::models
