// Every collective of every backend, on 1..4 ranks, element counts 0, 1, odd and large, checked
// against values computed independently (collective_checks.h): ranks as threads of one process
// over an in-memory store, and ranks as forked processes meeting through a file store. The same
// checks run under mpirun in test_collectives_mpi.cpp.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "collective_checks.h"
#include "shoal/comm/init.h"
#include "shoal/error.h"
#include "testing/multi_rank.h"

namespace shoal::comm {
namespace {

using shoal::comm::testing::all_checks;
using shoal::comm::testing::element_counts;

struct Case {
  std::string backend;
  int world_size;
  size_t check;  // index into all_checks()
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  return info.param.backend + "_w" + std::to_string(info.param.world_size) + "_" +
         all_checks()[info.param.check].name;
}

class Collectives : public ::testing::TestWithParam<Case> {};

// One thread per rank, each with its own group over one hash store; every element count in turn.
TEST_P(Collectives, OnThreads) {
  const Case c = GetParam();
  auto store = make_hash_store(Milliseconds(60'000));
  shoal::testing::run_threads(c.world_size, [&](int rank) {
    auto pg = new_process_group(c.backend, store, rank, c.world_size, Milliseconds(60'000));
    for (int64_t numel : element_counts()) all_checks()[c.check].fn(*pg, numel);
  });
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (const std::string backend : {"gloo", "shm", "hierarchical"}) {
    for (int w = 1; w <= 4; ++w) {
      for (size_t check = 0; check < all_checks().size(); ++check) {
        out.push_back({backend, w, check});
      }
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Backends, Collectives, ::testing::ValuesIn(cases()), case_name);

// Ranks as forked processes meeting through a file store: every check, every element count.
class CollectivesAcrossProcesses : public ::testing::TestWithParam<int> {};

TEST_P(CollectivesAcrossProcesses, Gloo) {
  const int world_size = GetParam();
  auto results = shoal::testing::run_processes(
      world_size,
      [&](int rank, const std::string& store_path) {
        torch::set_num_threads(1);
        auto store = make_file_store(store_path, world_size, Milliseconds(30'000));
        auto pg = new_process_group("gloo", store, rank, world_size, Milliseconds(30'000));
        for (int64_t numel : element_counts()) {
          for (const auto& check : all_checks()) check.fn(*pg, numel);
        }
      },
      Milliseconds(100'000));
  for (const auto& r : results) {
    EXPECT_TRUE(r.ok()) << "rank " << r.rank << " exit " << r.exit_code << " signal " << r.signal
                        << ": " << r.error;
  }
}

// World size 4 costs the most on two cores; 2 and 3 cover even and odd.
INSTANTIATE_TEST_SUITE_P(WorldSizes, CollectivesAcrossProcesses, ::testing::Values(2, 3),
                         [](const auto& info) { return "w" + std::to_string(info.param); });

TEST(ProcessGroupArguments, NonContiguousIsRefusedClearly) {
  auto store = make_hash_store();
  auto pg = new_process_group("gloo", store, 0, 1);
  auto t = torch::ones({4, 4}).t();
  try {
    pg->allreduce(t);
    FAIL() << "expected an error";
  } catch (const shoal::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("not contiguous"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace shoal::comm
