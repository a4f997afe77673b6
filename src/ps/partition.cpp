#include "shoal/ps/partition.h"

#include <algorithm>

#include "shoal/error.h"

namespace shoal::ps {

std::vector<Segment> partition_parameters(const std::vector<int64_t>& numels, int num_servers,
                                          int64_t split_threshold) {
  SHOAL_CHECK_T(InvalidArgument, num_servers >= 1, "partition: need at least one server, got ",
                num_servers);
  std::vector<int64_t> load(static_cast<size_t>(num_servers), 0);
  std::vector<Segment> segments;
  for (size_t p = 0; p < numels.size(); ++p) {
    const int64_t n = numels[p];
    if (n >= split_threshold && num_servers > 1 && n >= num_servers) {
      for (int s = 0; s < num_servers; ++s) {
        const int64_t begin = n * s / num_servers;
        const int64_t end = n * (s + 1) / num_servers;
        segments.push_back({static_cast<int>(p), begin, end - begin, s});
        load[static_cast<size_t>(s)] += end - begin;
      }
    } else {
      const int s = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
      segments.push_back({static_cast<int>(p), 0, n, s});
      load[static_cast<size_t>(s)] += n;
    }
  }
  return segments;
}

}  // namespace shoal::ps
