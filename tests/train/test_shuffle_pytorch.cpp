// Oracle: shuffled_indices(n, seed, epoch) is the permutation PyTorch's DistributedSampler
// (num_replicas=1, shuffle=True, seed=seed) yields after set_epoch(epoch), so a run's data order
// can be reproduced in Python.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <sstream>

#include "shoal/train/strategy.h"
#include "testing/multi_rank.h"
#include "testing/python.h"

namespace test_shuffle_pytorch {

TEST(ShuffleVsPyTorch, MatchesDistributedSampler) {
  const std::string script =
      "import sys\n"
      "try:\n"
      "    import torch.utils.data as d\n"
      "except ImportError:\n"
      "    sys.exit(77)\n"
      "for seed, epoch in ((0, 0), (0, 1), (123, 4)):\n"
      "    s = d.DistributedSampler(range(1000), num_replicas=1, rank=0, shuffle=True, seed=seed)\n"
      "    s.set_epoch(epoch)\n"
      "    print(' '.join(map(str, list(s))))\n" +
      shoal::testing::closing_line_code("3 permutations");
  const auto result = shoal::testing::run_python_code(script);
  // Exit 77: torch cannot be imported (checked inside, so that torch is imported once only).
  if (result.exit_code == shoal::testing::kNoTorchExitCode) {
    shoal::testing::skip_program(shoal::testing::Dependency::kPythonTorch, "python3-torch is not installed");
  }
  ASSERT_TRUE(shoal::testing::oracle_succeeded(result));
  const std::string& text = result.out;
  std::istringstream lines(text);
  for (const auto& [seed, epoch] : {std::pair<uint64_t, int64_t>{0, 0}, {0, 1}, {123, 4}}) {
    std::string line;
    ASSERT_TRUE(std::getline(lines, line));
    std::istringstream values(line);
    std::vector<int64_t> theirs;
    for (int64_t v; values >> v;) theirs.push_back(v);
    const torch::Tensor ours = shoal::train::shuffled_indices(1000, seed, epoch);
    ASSERT_EQ(static_cast<int64_t>(theirs.size()), ours.size(0));
    EXPECT_TRUE(torch::equal(ours, torch::tensor(theirs, torch::kLong)))
        << "seed " << seed << " epoch " << epoch;
  }
}

}  // namespace test_shuffle_pytorch
