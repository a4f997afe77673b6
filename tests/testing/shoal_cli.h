// The shoal executable, for tests that run it on the real Fashion-MNIST as a user would.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>
#include <vector>

#include "shoal/checkpoint/state_dict.h"
#include "testing/idx_files.h"
#include "testing/multi_rank.h"

namespace shoal::testing {

/// build/apps/shoal/shoal (from ctest's SHOAL_BINARY_DIR). Skips the program when the dataset is
/// missing (a failure under SHOAL_REQUIRE_ORACLES=1) or when not run through ctest.
inline std::string shoal_cli_with_dataset() {
  if (!have_real_fashion_mnist()) {
    skip_program("Fashion-MNIST is not installed (apt-get install dataset-fashion-mnist)");
  }
  const char* dir = std::getenv("SHOAL_BINARY_DIR");
  if (dir == nullptr) skip_program("SHOAL_BINARY_DIR is not set (run through ctest)");
  const std::string path = std::string(dir) + "/apps/shoal/shoal";
  if (!std::filesystem::exists(path)) skip_program(path + " is not built");
  return path;
}

/// The value of `key` (a number) on each "step" line of a `--metrics` JSON-lines file, in order.
inline std::vector<double> step_metrics(const std::string& path, const std::string& key) {
  std::vector<double> values;
  std::ifstream metrics(path);
  const std::regex number("\"" + key + "\":([-+0-9.eE]+)");
  for (std::string line; std::getline(metrics, line);) {
    std::smatch match;
    if (line.find("\"event\":\"step\"") != std::string::npos &&
        std::regex_search(line, match, number)) {
      values.push_back(std::stod(match[1]));
    }
  }
  return values;
}

/// The largest difference between two state dicts of the same keys (what `--dump-parameters`
/// wrote for two runs), each tensor's relative to its largest value in `b`.
inline double max_relative_difference(const checkpoint::StateDict& a, const checkpoint::StateDict& b) {
  double worst = 0;
  for (const auto& item : a) {
    const at::Tensor* other = b.find(item.key());
    if (other == nullptr || !other->sizes().equals(item.value().sizes())) return INFINITY;
    worst = std::max(worst, (item.value() - *other).abs().max().item<double>() /
                                std::max(other->abs().max().item<double>(), 1e-12));
  }
  return a.size() == b.size() ? worst : INFINITY;
}

}  // namespace shoal::testing
