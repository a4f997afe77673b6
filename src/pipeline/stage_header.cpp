#include "pipeline/stage_header.h"

#include <cstring>

#include "shoal/error.h"

namespace shoal::pipeline {
namespace {

// "SHOALPIP": catches a stream that is out of step (a message read as a header that is not one).
constexpr int64_t kMagic = 0x5348'4F41'4C50'4950;

bool allowed_dtype(int64_t code) {
  for (at::ScalarType type : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16, at::kLong,
                              at::kInt}) {
    if (code == static_cast<int64_t>(type)) return true;
  }
  return false;
}

}  // namespace

const char* kind_name(StageHeader::Kind kind) {
  switch (kind) {
    case StageHeader::Kind::kActivation:
      return "activation";
    case StageHeader::Kind::kGradient:
      return "gradient";
    case StageHeader::Kind::kError:
      return "error";
  }
  return "unknown";
}

void StageHeader::encode(int64_t* words) const {
  std::memset(words, 0, kWords * sizeof(int64_t));
  words[0] = kMagic;
  words[1] = static_cast<int64_t>(kind);
  words[2] = step;
  words[3] = micro_batch;
  if (kind == Kind::kError) {
    words[4] = static_cast<int64_t>(at::kByte);
    words[5] = 1;
    words[6] = error_bytes;
    return;
  }
  SHOAL_CHECK_T(InvalidArgument, sizes.size() <= static_cast<size_t>(kMaxDims), "a ",
                kind_name(kind), " with ", sizes.size(),
                " dimensions cannot be sent to another pipeline stage (at most ", kMaxDims, ")");
  words[4] = static_cast<int64_t>(dtype);
  words[5] = static_cast<int64_t>(sizes.size());
  for (size_t d = 0; d < sizes.size(); ++d) words[6 + d] = sizes[d];
}

StageHeader StageHeader::decode(const int64_t* h, int64_t max_message_bytes,
                                const std::string& what) {
  SHOAL_CHECK_T(PeerError, h[0] == kMagic, what, " failed: the message is not a pipeline header "
                "(the two stages are out of step)");
  StageHeader header;
  header.step = h[2];
  header.micro_batch = h[3];
  if (h[1] == static_cast<int64_t>(Kind::kError)) {
    header.kind = Kind::kError;
    header.dtype = at::kByte;
    header.error_bytes = h[6];
    SHOAL_CHECK_T(PeerError, header.error_bytes >= 0 && header.error_bytes <= kMaxErrorBytes,
                  what, " failed: the sender failed (its error message of ", header.error_bytes,
                  " bytes is out of bounds)");
    return header;
  }
  SHOAL_CHECK_T(PeerError, h[1] == static_cast<int64_t>(Kind::kActivation) ||
                               h[1] == static_cast<int64_t>(Kind::kGradient),
                what, " failed: unknown message kind ", h[1], " in the header");
  header.kind = static_cast<Kind>(h[1]);
  SHOAL_CHECK_T(PeerError, allowed_dtype(h[4]), what, " failed: unsupported dtype code ", h[4]);
  header.dtype = static_cast<at::ScalarType>(h[4]);
  const int64_t dims = h[5];
  SHOAL_CHECK_T(PeerError, dims >= 0 && dims <= kMaxDims, what, " failed: ", dims,
                " dimensions in the header (at most ", kMaxDims, ")");
  int64_t bytes = static_cast<int64_t>(c10::elementSize(header.dtype));
  for (int64_t d = 0; d < dims; ++d) {
    const int64_t size = h[6 + d];
    SHOAL_CHECK_T(PeerError, size >= 0, what, " failed: negative size ", size, " in the header");
    SHOAL_CHECK_T(PeerError, size == 0 || bytes <= max_message_bytes / size, what,
                  " failed: the header announces more than max_message_bytes (",
                  max_message_bytes, " bytes)");
    bytes *= size;
    header.sizes.push_back(size);
  }
  return header;
}

}  // namespace shoal::pipeline
