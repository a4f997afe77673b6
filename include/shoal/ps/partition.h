// How parameters are spread over parameter servers: each tensor is one key range or, when it is
// large, split into one contiguous range per server, so that shards stay balanced; the small ones
// go whole to the server with the fewest elements so far. Every worker computes the same
// partition from the same parameter sizes.
//
// Thread safety: pure functions.
#pragma once

#include <cstdint>
#include <vector>

namespace shoal::ps {

/// One key range: elements [offset, offset + numel) of parameter `param`, owned by `server`.
/// Its key id is its index in the partition.
struct Segment {
  int param = 0;
  int64_t offset = 0;
  int64_t numel = 0;
  int server = 0;
};

/// Why 65536 elements (256 KiB): below it a tensor costs less whole than as S messages' worth of
/// per-range overhead; above it splitting evens the servers' work.
constexpr int64_t kDefaultSplitThreshold = 65536;

/// The partition of parameters with these element counts over `num_servers` servers.
std::vector<Segment> partition_parameters(const std::vector<int64_t>& numels, int num_servers,
                                          int64_t split_threshold = kDefaultSplitThreshold);

}  // namespace shoal::ps
