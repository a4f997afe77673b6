// Oracle: Python PyTorch (Debian's python3-torch), building the same model after
// torch.manual_seed(seed), gets bit-identical initial weights, the same parameter order, and the
// same logits (to float tolerance) as shoal::models::create(name, seed).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "shoal/models/registry.h"
#include "testing/multi_rank.h"
#include "testing/python.h"

namespace shoal::models {
namespace test_models_pytorch {

constexpr const char* kPython = "/usr/bin/python3";

// Runs the Python twin; returns its stdout ("name numel" lines) and fills `values`.
std::string run_python(const std::string& name, uint64_t seed, std::vector<float>& values) {
  const char* source = std::getenv("SHOAL_SOURCE_DIR");
  if (source == nullptr) shoal::testing::skip_program(shoal::testing::Dependency::kOptional, "SHOAL_SOURCE_DIR is not set (run through ctest)");
  const std::string out = shoal::testing::temp_path("shoal-pytorch-model");
  const std::string command = std::string(kPython) + " " + source + "/tests/models/pytorch_models.py " +
                              name + " " + std::to_string(seed) + " " + out;
  const auto run = shoal::testing::run_command(command);
  // The script exits 77 when it cannot import torch (importing it is the slow part: once only).
  if (run.exit_code == shoal::testing::kNoTorchExitCode) {
    shoal::testing::skip_program(shoal::testing::Dependency::kPythonTorch, "python3-torch is not installed");
  }
  EXPECT_TRUE(shoal::testing::oracle_succeeded(run)) << command;
  // The listing without its closing line.
  std::string listing;
  std::istringstream lines(run.out);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind(shoal::testing::kOracleClosing, 0) != 0) listing += line + "\n";
  }
  std::ifstream in(out, std::ios::binary | std::ios::ate);
  const auto bytes = static_cast<size_t>(in.tellg());
  in.seekg(0);
  values.resize(bytes / sizeof(float));
  in.read(reinterpret_cast<char*>(values.data()), static_cast<std::streamsize>(bytes));
  std::filesystem::remove(out);
  return listing;
}

void check(const std::string& name, uint64_t seed) {
  std::vector<float> values;
  const std::string listing = run_python(name, seed, values);
  torch::set_num_threads(1);
  auto model = create(name, seed);
  std::ostringstream expected_listing;
  size_t offset = 0;
  for (const auto& item : model->named_parameters()) {
    expected_listing << item.key() << " " << item.value().numel() << "\n";
    const auto n = static_cast<size_t>(item.value().numel());
    ASSERT_LE(offset + n, values.size());
    const torch::Tensor theirs =
        torch::from_blob(values.data() + offset, item.value().sizes(), torch::kFloat);
    EXPECT_TRUE(torch::equal(item.value(), theirs)) << name << " " << item.key();
    offset += n;
  }
  EXPECT_EQ(listing, expected_listing.str());
  ASSERT_EQ(values.size(), offset + 20);
  torch::NoGradGuard no_grad;
  const torch::Tensor logits = model->forward(torch::linspace(-1, 1, 2 * 784).reshape({2, 1, 28, 28}));
  const torch::Tensor theirs = torch::from_blob(values.data() + offset, {2, 10}, torch::kFloat);
  EXPECT_TRUE(torch::allclose(logits, theirs, 1e-4, 1e-5)) << logits << theirs;
}

TEST(ModelsVsPyTorch, CnnInitMatches) { check("cnn", 42); }
TEST(ModelsVsPyTorch, MlpInitMatches) { check("mlp", 7); }
TEST(ModelsVsPyTorch, TransformerInitMatches) { check("transformer", 3); }

}  // namespace test_models_pytorch
}  // namespace shoal::models
