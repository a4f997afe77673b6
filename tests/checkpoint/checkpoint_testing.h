// Helpers shared by the checkpoint tests: the small model both C++ and Python build, running the
// PyTorch oracle script, and bit-for-bit comparison of state dicts.
#pragma once

#include <gtest/gtest.h>
#include <torch/nn/modules/container/sequential.h>

#include <string>

#include "shoal/checkpoint/state_dict.h"
#include "testing/dependencies.h"

namespace shoal::testing {

/// Skips the current test (see SHOAL_SKIP_TEST) when /usr/bin/python3 cannot import torch.
#define SHOAL_REQUIRE_PYTHON_TORCH()                                                    \
  SHOAL_SKIP_UNLESS(::shoal::testing::python_has_torch(), ::shoal::testing::Dependency::kPythonTorch, \
                    "/usr/bin/python3 with torch (Debian's python3-torch) is not installed")

/// Linear(4, 8), BatchNorm1d(8), ReLU, Linear(8, 3): the same keys as torch_oracle.py's net().
torch::nn::Sequential make_net();

/// Runs `/usr/bin/python3 torch_oracle.py ARGS`; success when it exited 0 with its closing line
/// ("ORACLE OK ..."); else a failure showing its exit status and output.
::testing::AssertionResult run_oracle(const std::string& args);

/// "" when equal key by key, dtype and every bit; else what differs.
std::string compare_state_dicts(const checkpoint::StateDict& a, const checkpoint::StateDict& b);

/// A fresh empty folder.
std::string temp_dir(const std::string& stem);

}  // namespace shoal::testing
