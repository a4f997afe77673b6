// libFuzzer target: the pipeline stages' message header (StageHeader::decode) on arbitrary words,
// as a neighbouring stage out of step or a broken peer can send them. Every input must be refused
// with PeerError or decode to a header whose tensor fits max_message_bytes.
#include <cstdint>
#include <cstring>

#include "pipeline/stage_header.h"
#include "shoal/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using shoal::pipeline::StageHeader;
  int64_t words[StageHeader::kWords] = {};
  std::memcpy(words, data, std::min(size, sizeof words));
  constexpr int64_t kMaxBytes = int64_t{1} << 30;
  try {
    const StageHeader header = StageHeader::decode(words, kMaxBytes, "fuzz");
    if (header.kind == StageHeader::Kind::kError) {
      if (header.error_bytes < 0 || header.error_bytes > StageHeader::kMaxErrorBytes) __builtin_trap();
      return 0;
    }
    if (header.sizes.size() > static_cast<size_t>(StageHeader::kMaxDims)) __builtin_trap();
    // What the receiver would allocate, computed without overflow.
    __int128 bytes = static_cast<__int128>(c10::elementSize(header.dtype));
    for (int64_t s : header.sizes) {
      if (s < 0) __builtin_trap();
      bytes *= s;
      if (bytes > kMaxBytes) __builtin_trap();
    }
    int64_t again[StageHeader::kWords];
    header.encode(again);  // what decodes must encode back to the same words
    if (std::memcmp(again, words, 6 * sizeof(int64_t) + header.sizes.size() * sizeof(int64_t)) != 0) {
      __builtin_trap();
    }
  } catch (const shoal::PeerError&) {
  }
  return 0;
}
