// The shoal executable, for tests that run it on the real Fashion-MNIST as a user would.
#pragma once

#include <cstdlib>
#include <filesystem>
#include <string>

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

}  // namespace shoal::testing
