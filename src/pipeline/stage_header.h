// StageHeader: the fixed-size header in front of every message between pipeline stages, and its
// checks (StageTransport sends and receives it; fuzz/fuzz_stage_header.cpp feeds it garbage).
//
// kWords int64 words: magic, kind, step, micro-batch, dtype code, dimension count, then the sizes
// (or, for an error message, its byte count). decode() bounds everything a peer controls before
// the receiver allocates anything: the kind, the dtype, the dimension count, each size and the
// total bytes against max_message_bytes, and the length of an error text.
//
// Thread safety: a value type; the functions are pure.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <string>
#include <vector>

namespace shoal::pipeline {

struct StageHeader {
  enum class Kind : int64_t { kActivation = 1, kGradient = 2, kError = 3 };

  static constexpr int kWords = 16;
  static constexpr int kMaxDims = kWords - 6;
  /// Error texts are cut to this length: enough for a message naming rank, stage and cause.
  static constexpr int64_t kMaxErrorBytes = 4096;

  Kind kind = Kind::kActivation;
  int64_t step = 0;
  int64_t micro_batch = 0;
  at::ScalarType dtype = at::kFloat;  ///< at::kByte for an error message
  std::vector<int64_t> sizes;         ///< the tensor's; empty for an error message
  int64_t error_bytes = 0;            ///< the error text's length (kError only)

  /// Writes the header into words[0..kWords). Throws InvalidArgument beyond kMaxDims dimensions.
  void encode(int64_t* words) const;
  /// Reads and checks words[0..kWords); throws PeerError "<what> failed: ..." on anything out of
  /// bounds or not a header at all.
  static StageHeader decode(const int64_t* words, int64_t max_message_bytes,
                            const std::string& what);
};

/// "activation", "gradient", "error".
const char* kind_name(StageHeader::Kind kind);

}  // namespace shoal::pipeline
