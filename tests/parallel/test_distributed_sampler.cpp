// DistributedSampler: PyTorch's semantics (cover, pad, drop_last, set_epoch), and the very same
// index lists as Python's torch.utils.data.DistributedSampler (Debian's python3-torch).
#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>
#include <map>
#include <set>
#include <sstream>

#include "shoal/data/distributed_sampler.h"
#include "shoal/error.h"
#include "testing/dependencies.h"
#include "testing/python.h"

namespace shoal::data {
namespace test_distributed_sampler {

std::vector<std::vector<size_t>> all_ranks(size_t n, int replicas, DistributedSamplerOptions o,
                                           uint64_t epoch = 0) {
  std::vector<std::vector<size_t>> out;
  for (int r = 0; r < replicas; ++r) {
    DistributedSampler sampler(n, r, replicas, o);
    sampler.set_epoch(epoch);
    out.push_back(sampler.indices());
    EXPECT_EQ(out.back().size(), sampler.size());
  }
  return out;
}

TEST(DistributedSampler, PartitionsCoverTheDatasetAndPadFromTheStart) {
  for (size_t n : {0, 1, 7, 10, 12}) {
    for (int replicas : {1, 2, 3, 4}) {
      for (bool shuffle : {false, true}) {
        DistributedSamplerOptions o;
        o.shuffle = shuffle;
        auto parts = all_ranks(n, replicas, o);
        const size_t per_rank = (n + replicas - 1) / replicas;
        std::map<size_t, int> seen;
        for (const auto& p : parts) {
          ASSERT_EQ(p.size(), per_rank);
          for (size_t i : p) ++seen[i];
        }
        ASSERT_EQ(seen.size(), n) << "n=" << n << " replicas=" << replicas;
        size_t repeats = 0;
        for (auto& [index, count] : seen) repeats += count - 1;
        EXPECT_EQ(repeats, per_rank * replicas - n);
        if (!shuffle && n > 0 && per_rank * replicas > n) {
          // Padding repeats the first indices: the last rank's last index wraps around to 0.
          EXPECT_EQ(parts[(n % replicas)][per_rank - 1], 0u);
        }
      }
    }
  }
}

TEST(DistributedSampler, DropLastDropsTheTail) {
  DistributedSamplerOptions o;
  o.drop_last = true;
  o.shuffle = false;
  auto parts = all_ranks(10, 3, o);
  for (const auto& p : parts) EXPECT_EQ(p.size(), 3u);
  std::set<size_t> seen;
  for (const auto& p : parts) seen.insert(p.begin(), p.end());
  EXPECT_EQ(seen.size(), 9u);
  EXPECT_EQ(seen.count(9), 0u);
  EXPECT_EQ(all_ranks(2, 3, o)[0].size(), 0u);
}

// drop_last, worked out by hand from PyTorch's definition: every rank gets floor(n / replicas)
// indices (a dataset that divides evenly loses nothing: 12 on 3 ranks is 4 each), the kept ones are
// the first replicas * floor(n / replicas) of the epoch's order, each exactly once, dealt round-robin.
TEST(DistributedSampler, DropLastKeepsEveryIndexWhenTheSizeDivides) {
  for (size_t n : {0, 1, 2, 3, 4, 5, 6, 8, 9, 11, 12, 13, 16, 17}) {
    for (int replicas : {1, 2, 3, 4}) {
      for (bool shuffle : {false, true}) {
        SCOPED_TRACE("n=" + std::to_string(n) + " replicas=" + std::to_string(replicas) +
                     (shuffle ? " shuffled" : " in order"));
        DistributedSamplerOptions o;
        o.drop_last = true;
        o.shuffle = shuffle;
        o.seed = 9;
        const size_t per_rank = n / static_cast<size_t>(replicas);
        const size_t kept = per_rank * static_cast<size_t>(replicas);
        // The epoch's order with nothing dropped (one rank holding everything) is the reference.
        DistributedSamplerOptions whole = o;
        whole.drop_last = false;
        const auto order = DistributedSampler(n, 0, 1, whole).indices();
        ASSERT_EQ(order.size(), n);
        const auto parts = all_ranks(n, replicas, o);
        std::set<size_t> seen;
        for (int r = 0; r < replicas; ++r) {
          ASSERT_EQ(parts[r].size(), per_rank) << "rank " << r;
          for (size_t k = 0; k < per_rank; ++k) {
            EXPECT_EQ(parts[r][k], order[k * replicas + r]) << "rank " << r << " position " << k;
          }
          seen.insert(parts[r].begin(), parts[r].end());
        }
        EXPECT_EQ(seen.size(), kept) << "an index repeated";
        if (n % replicas == 0) {
          EXPECT_EQ(seen.size(), n) << "a dataset that divides evenly lost indices";
        }
        DistributedSampler sampler(n, 0, replicas, o);
        EXPECT_EQ(sampler.size(), per_rank);
        EXPECT_EQ(sampler.total_size(), kept);
      }
    }
  }
  // The example, written out: 12 samples on 3 ranks, in order.
  DistributedSamplerOptions o;
  o.drop_last = true;
  o.shuffle = false;
  const auto parts = all_ranks(12, 3, o);
  EXPECT_EQ(parts[0], (std::vector<size_t>{0, 3, 6, 9}));
  EXPECT_EQ(parts[1], (std::vector<size_t>{1, 4, 7, 10}));
  EXPECT_EQ(parts[2], (std::vector<size_t>{2, 5, 8, 11}));
}

TEST(DistributedSampler, SetEpochChangesTheOrderDeterministically) {
  DistributedSampler a(100, 0, 2), b(100, 0, 2);
  auto first = a.indices();
  EXPECT_EQ(first, b.indices());
  a.set_epoch(1);
  EXPECT_NE(first, a.indices());
  b.set_epoch(1);
  EXPECT_EQ(a.indices(), b.indices());
  std::vector<size_t> sorted = first;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_NE(sorted, first);
}

TEST(DistributedSampler, WorksAsATorchDataSampler) {
  DistributedSampler sampler(10, 1, 2, false);
  auto batch = sampler.next(3);
  ASSERT_TRUE(batch.has_value());
  EXPECT_EQ(*batch, (std::vector<size_t>{1, 3, 5}));
  EXPECT_EQ(*sampler.next(3), (std::vector<size_t>{7, 9}));
  EXPECT_FALSE(sampler.next(3).has_value());
  sampler.reset();
  EXPECT_EQ(sampler.next(10)->size(), 5u);
  EXPECT_THROW(DistributedSampler(10, 2, 2), InvalidArgument);
}

// save() then load() into a fresh sampler resumes mid-epoch: the same epoch's order from the
// same position, through a real archive written to bytes and read back.
TEST(DistributedSampler, SaveAndLoadResumeMidEpoch) {
  DistributedSamplerOptions o;
  o.seed = 5;
  DistributedSampler sampler(103, 1, 3, o);
  sampler.set_epoch(4);
  ASSERT_TRUE(sampler.next(10).has_value());
  ASSERT_TRUE(sampler.next(7).has_value());  // 17 of this rank's 35 taken
  std::ostringstream bytes;
  {
    torch::serialize::OutputArchive archive;
    sampler.save(archive);
    archive.save_to(bytes);
  }
  DistributedSampler resumed(103, 1, 3, o);  // epoch 0, position 0
  {
    std::istringstream in(bytes.str());
    torch::serialize::InputArchive archive;
    archive.load_from(in);
    resumed.load(archive);
  }
  EXPECT_EQ(resumed.epoch(), 4u);
  std::vector<size_t> rest, expected;
  while (auto batch = resumed.next(8)) rest.insert(rest.end(), batch->begin(), batch->end());
  while (auto batch = sampler.next(8)) expected.insert(expected.end(), batch->begin(), batch->end());
  EXPECT_EQ(rest.size(), 35u - 17u);
  EXPECT_EQ(rest, expected);
  const auto all = sampler.indices();
  EXPECT_EQ(rest, std::vector<size_t>(all.begin() + 17, all.end()));
}

struct SamplerCase {
  size_t n;
  int replicas;
  bool shuffle;
  uint64_t seed;
  bool drop_last;
  uint64_t epoch;
};

const std::vector<SamplerCase> kSamplerCases = {
    {10, 3, true, 4, false, 2},    {10, 3, true, 0, true, 0}, {1000, 4, true, 17, false, 5},
    {7, 2, false, 0, false, 0},    {5, 8, true, 1, false, 3}, {60000, 3, true, 0, false, 1},
    // drop_last with sizes that divide (nothing dropped) and that do not, shuffled and in order.
    {12, 3, false, 0, true, 0},    {12, 3, true, 5, true, 1}, {12, 4, true, 2, true, 0},
    {13, 4, false, 0, true, 0},    {13, 4, true, 3, true, 2}, {8, 2, true, 0, true, 4},
    {3, 4, true, 0, true, 0},      {60000, 4, true, 1, true, 1}};

// Runs `prelude`, then imports torch (exit kNoTorchExitCode without it) and prints one
// DistributedSampler's indices per case and rank, in /usr/bin/python3 (torch imported once: it is
// the slow part).
shoal::testing::PythonResult run_sampler_oracle(const std::string& prelude) {
  std::ostringstream script;
  script << prelude << shoal::testing::kImportTorchOrExit
         << "from torch.utils.data import DistributedSampler\n";
  for (const auto& c : kSamplerCases) {
    for (int r = 0; r < c.replicas; ++r) {
      script << "s = DistributedSampler(range(" << c.n << "), num_replicas=" << c.replicas
             << ", rank=" << r << ", shuffle=" << (c.shuffle ? "True" : "False")
             << ", seed=" << c.seed << ", drop_last=" << (c.drop_last ? "True" : "False")
             << ")\ns.set_epoch(" << c.epoch << ")\nprint(\" \".join(map(str, s)))\n";
    }
  }
  script << shoal::testing::closing_line_code(std::to_string(kSamplerCases.size()) + " cases");
  return shoal::testing::run_python_code(script.str());
}

// Asserts each printed index list equals ours. A failed script, or one that did not print its
// closing line, is a failure showing its output.
void expect_equals_python_sampler(const shoal::testing::PythonResult& result) {
  ASSERT_TRUE(shoal::testing::oracle_succeeded(result));
  std::istringstream lines(result.out);
  for (const auto& c : kSamplerCases) {
    for (int r = 0; r < c.replicas; ++r) {
      std::string line;
      ASSERT_TRUE(std::getline(lines, line)) << "the oracle printed too few lines";
      DistributedSamplerOptions o;
      o.shuffle = c.shuffle;
      o.seed = c.seed;
      o.drop_last = c.drop_last;
      DistributedSampler sampler(c.n, r, c.replicas, o);
      sampler.set_epoch(c.epoch);
      std::ostringstream mine;
      auto indices = sampler.indices();
      for (size_t i = 0; i < indices.size(); ++i) mine << (i ? " " : "") << indices[i];
      ASSERT_EQ(mine.str(), line) << "n=" << c.n << " replicas=" << c.replicas << " rank=" << r;
    }
  }
}

TEST(DistributedSampler, EqualsPythonsDistributedSampler) {
  const auto result = run_sampler_oracle("");
  SHOAL_SKIP_UNLESS(result.exit_code != shoal::testing::kNoTorchExitCode,
                    shoal::testing::Dependency::kPythonTorch,
                    "/usr/bin/python3 with torch is not available");
  expect_equals_python_sampler(result);
}

// The comparison cannot pass quietly: an oracle script that fails for any other reason than a
// missing torch is a failure naming its stderr (the script fails before importing torch, so this
// runs everywhere), and a wrong line is a mismatch.
// An oracle that "succeeded" with the first case's rank 0 unshuffled (the real one is shuffled).
shoal::testing::PythonResult unshuffled_first_line() {
  shoal::testing::PythonResult result;
  result.exit_code = 0;
  result.out = "0 3 6 9\nORACLE OK 1 cases\n";
  return result;
}

// An interpreter that printed nothing and exited 0.
shoal::testing::PythonResult silent_oracle() {
  shoal::testing::PythonResult result;
  result.exit_code = 0;
  return result;
}

TEST(DistributedSampler, BrokenOracleIsAFailureNotASkip) {
  EXPECT_FATAL_FAILURE(
      expect_equals_python_sampler(run_sampler_oracle("raise RuntimeError('oracle broken on purpose')\n")),
      "oracle broken on purpose");
  EXPECT_FATAL_FAILURE(expect_equals_python_sampler(unshuffled_first_line()), "rank=0");
  EXPECT_FATAL_FAILURE(expect_equals_python_sampler(silent_oracle()), "without its closing line");
}

}  // namespace test_distributed_sampler
}  // namespace shoal::data
