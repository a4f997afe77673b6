// The hierarchical backend over pretended hosts (SHOAL_HOSTNAME set per forked rank): every
// collective from every root, in float32 and int64, with 0, 1, an odd number and 2^18 elements,
// on even, uneven, interleaved and three-host layouts, compared with values computed here; the
// shared collective checks on the same layouts; and a rank killed in the middle of a collective.
#include <gtest/gtest.h>
#include <signal.h>
#include <torch/torch.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "collective_checks.h"
#include "comm/hierarchical/process_group_hierarchical.h"
#include "shoal/comm/init.h"
#include "shoal/error.h"
#include "testing/multi_rank.h"

namespace shoal::comm {
namespace test_hierarchical {

using shoal::testing::ProcessResult;
using shoal::testing::run_processes;

const Milliseconds kTimeout(20'000);

struct Layout {
  std::string name;
  std::vector<std::string> hosts;  // the pretended host of each rank
  int num_hosts;
};

const std::vector<Layout>& layouts() {
  static const std::vector<Layout> all = {
      {"TwoPlusTwo", {"a", "a", "b", "b"}, 2},
      {"TwoPlusOne", {"a", "a", "b"}, 2},
      // A host's ranks need not be consecutive: outputs must still come in rank order.
      {"Interleaved", {"a", "b", "a", "b"}, 2},
      // Three leaders, and hosts of one rank (no local stage) beside one of two.
      {"ThreeHosts", {"a", "b", "b", "c"}, 3},
  };
  return all;
}

std::string messages(const std::vector<ProcessResult>& results) {
  std::string out;
  for (const auto& r : results) {
    out += "rank " + std::to_string(r.rank) + ": exit " + std::to_string(r.exit_code) +
           " signal " + std::to_string(r.signal) + " " + r.error + "\n";
  }
  return out;
}

std::shared_ptr<ProcessGroup> join(const Layout& layout, int rank, const std::string& path,
                                   Milliseconds timeout = kTimeout) {
  const int world = static_cast<int>(layout.hosts.size());
  setenv("SHOAL_HOSTNAME", layout.hosts[rank].c_str(), 1);
  auto store = make_file_store(path, world, timeout);
  auto pg = new_process_group("hierarchical", store, rank, world, timeout);
  auto* hier = dynamic_cast<ProcessGroupHierarchical*>(pg.get());
  SHOAL_CHECK(hier != nullptr && hier->num_hosts() == layout.num_hosts, "expected ",
              layout.num_hosts, " hosts, got ", hier ? hier->num_hosts() : -1);
  return pg;
}

// The odd count is 2-D, so that the backend's flattening of shaped tensors is exercised too.
std::vector<int64_t> shape_of(int64_t numel) {
  return numel == 1001 ? std::vector<int64_t>{7, 143} : std::vector<int64_t>{numel};
}

// Input number `k` (a rank, or a rank plus a salt): small integers, exact in float32 and int64.
torch::Tensor input(int k, int64_t numel, torch::Dtype dtype) {
  return (torch::arange(numel, torch::kLong).remainder(7) + k + 1).to(dtype).view(shape_of(numel));
}

// op over inputs salt, salt + 1, ..., salt + world - 1, computed here as the backend must: sums
// (exact) divided once, truncating in integers.
torch::Tensor reduced(ReduceOp op, int world, int64_t numel, torch::Dtype dtype, int salt = 0) {
  auto out = input(salt, numel, torch::kLong);
  for (int r = 1; r < world; ++r) {
    auto x = input(salt + r, numel, torch::kLong);
    out = op == ReduceOp::kMax ? torch::maximum(out, x) : out + x;
  }
  if (op != ReduceOp::kAvg) return out.to(dtype);
  if (dtype == torch::kLong) return torch::div(out, world, "trunc");
  return out.to(dtype).div(world);
}

// "[3, 4, 5]": the first few values, on one line.
std::string head(const torch::Tensor& t) {
  std::string out;
  const auto values = t.flatten().slice(0, 0, 5).to(torch::kDouble);
  for (int64_t i = 0; i < values.numel(); ++i) {
    out += (i ? ", " : "") + std::to_string(values[i].item<double>());
  }
  return "[" + out + "]";
}

void expect_equal(const ProcessGroup& pg, const torch::Tensor& got, const torch::Tensor& want,
                  const std::string& what) {
  SHOAL_CHECK(got.scalar_type() == want.scalar_type() && got.sizes() == want.sizes() &&
                  torch::equal(got, want),
              pg.rank_prefix(), " ", what, ": got ", head(got), " want ", head(want));
}

void check_collectives(ProcessGroup& pg, int64_t numel, torch::Dtype dtype) {
  const int n = pg.size();
  const int me = pg.rank();
  const std::string of = " of " + std::to_string(numel) + " " + c10::toString(dtype);
  const std::vector<ReduceOp> ops = {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax};
  for (auto op : ops) {
    auto t = input(me, numel, dtype);
    pg.allreduce(t, {op})->wait();
    expect_equal(pg, t, reduced(op, n, numel, dtype),
                 std::string("allreduce ") + to_string(op) + of);
  }
  for (int root = 0; root < n; ++root) {
    const std::string from = of + " root " + std::to_string(root);
    auto b = input(me, numel, dtype);
    pg.broadcast(b, {root})->wait();
    expect_equal(pg, b, input(root, numel, dtype), "broadcast" + from);
    for (auto op : ops) {
      auto t = input(me, numel, dtype);
      pg.reduce(t, {root, op})->wait();
      if (me == root) {
        expect_equal(pg, t, reduced(op, n, numel, dtype),
                     std::string("reduce ") + to_string(op) + from);
      }
    }
    std::vector<torch::Tensor> gathered;
    if (me == root) {
      for (int r = 0; r < n; ++r) gathered.push_back(torch::full(shape_of(numel), -1, dtype));
    }
    pg.gather(gathered, input(me, numel, dtype), {root})->wait();
    for (size_t r = 0; r < gathered.size(); ++r) {
      expect_equal(pg, gathered[r], input(static_cast<int>(r), numel, dtype),
                   "gather from rank " + std::to_string(r) + from);
    }
    std::vector<torch::Tensor> pieces;
    if (me == root) {
      for (int r = 0; r < n; ++r) pieces.push_back(input(10 * root + r, numel, dtype));
    }
    auto piece = torch::full(shape_of(numel), -1, dtype);
    pg.scatter(piece, pieces, {root})->wait();
    expect_equal(pg, piece, input(10 * root + me, numel, dtype), "scatter" + from);
  }
  std::vector<torch::Tensor> all;
  for (int r = 0; r < n; ++r) all.push_back(torch::full(shape_of(numel), -1, dtype));
  pg.allgather(all, input(me, numel, dtype))->wait();
  for (int r = 0; r < n; ++r) {
    expect_equal(pg, all[r], input(r, numel, dtype),
                 "allgather from rank " + std::to_string(r) + of);
  }
  for (auto op : ops) {
    // Block j of every rank's list (rank + 10 j) lands, reduced, on rank j.
    std::vector<torch::Tensor> blocks;
    for (int j = 0; j < n; ++j) blocks.push_back(input(me + 10 * j, numel, dtype));
    auto out = torch::full(shape_of(numel), -1, dtype);
    pg.reduce_scatter(out, blocks, {op})->wait();
    expect_equal(pg, out, reduced(op, n, numel, dtype, 10 * me),
                 std::string("reduce_scatter ") + to_string(op) + of);
  }
  pg.barrier()->wait();
}

class HierarchicalLayouts : public ::testing::TestWithParam<size_t> {};

TEST_P(HierarchicalLayouts, EveryCollectiveEveryRoot) {
  const Layout& layout = layouts()[GetParam()];
  auto results = run_processes(
      static_cast<int>(layout.hosts.size()),
      [&](int rank, const std::string& path) {
        torch::set_num_threads(1);
        auto pg = join(layout, rank, path);
        for (int64_t numel : {int64_t{0}, int64_t{1}, int64_t{1001}, int64_t{1} << 18}) {
          for (auto dtype : {torch::kFloat, torch::kLong}) check_collectives(*pg, numel, dtype);
        }
        // The checks every backend passes (other dtypes, sub-groups, point-to-point), at one
        // odd count: the large counts are covered above.
        for (const auto& check : testing::all_checks()) check.fn(*pg, 1001);
      },
      Milliseconds(100'000));
  for (const auto& r : results) EXPECT_TRUE(r.ok()) << layout.name << "\n" << messages(results);
}

INSTANTIATE_TEST_SUITE_P(Hosts, HierarchicalLayouts, ::testing::Range<size_t>(0, 4),
                         [](const auto& info) { return layouts()[info.param].name; });

// A non-leader dies: its leader notices at once (shm), the other host's leader through Gloo, and
// its local rank learns from its leader's abort; nobody waits much past the time-out.
TEST(HierarchicalFaults, KilledRankFailsEveryoneNamingTheOperation) {
  const Layout& layout = layouts()[0];
  // Long enough that rank 0's Gloo failure (reported after up to 2 s of naming the culprit)
  // reaches rank 1 before rank 1's own wait would time out.
  const Milliseconds timeout(6'000);
  auto results = run_processes(4, [&](int rank, const std::string& path) {
    auto pg = join(layout, rank, path, timeout);
    std::vector<torch::Tensor> all;
    for (int r = 0; r < 4; ++r) all.push_back(torch::empty({1000}));
    pg->allgather(all, torch::ones({1000}))->wait();  // everyone is up
    if (rank == 3) raise(SIGKILL);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    pg->allgather(all, torch::ones({1000}))->wait();
  });
  ASSERT_EQ(results[3].signal, SIGKILL) << messages(results);
  for (int rank : {0, 1, 2}) {
    const auto& r = results[rank];
    EXPECT_FALSE(r.ok()) << messages(results);
    EXPECT_NE(r.error.find("allgather #"), std::string::npos) << messages(results);
    EXPECT_LT(r.seconds, 2.0 * timeout.count() / 1000.0) << r.error;
    std::cout << "rank " << rank << " reported: " << r.error << "\n";
  }
  // Rank 3's leader sees its process gone; rank 1 hears of the failure from its leader's abort.
  const std::string& leader_b = results[2].error;
  const std::string& member_a = results[1].error;
  EXPECT_NE(leader_b.find("the process has exited"), std::string::npos) << leader_b;
  EXPECT_NE(member_a.find("rank 0 aborted the group"), std::string::npos) << member_a;
}

}  // namespace test_hierarchical
}  // namespace shoal::comm
