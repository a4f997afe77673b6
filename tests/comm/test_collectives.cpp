// Every collective of every backend, on 1..4 ranks (threads of one process, in-memory store),
// element counts 0, 1, odd and large, checked against values computed here independently.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "shoal/comm/init.h"
#include "shoal/error.h"
#include "testing/multi_rank.h"

namespace shoal::comm {
namespace {

struct Case {
  std::string backend;
  int world_size;
  int64_t numel;
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  return info.param.backend + "_w" + std::to_string(info.param.world_size) + "_n" +
         std::to_string(info.param.numel);
}

class Collectives : public ::testing::TestWithParam<Case> {
 protected:
  // Runs fn(pg) on every rank, each rank a thread with its own group over one hash store.
  void run(const std::function<void(ProcessGroup&)>& fn) {
    const Case c = GetParam();
    auto store = make_hash_store(Milliseconds(60'000));
    shoal::testing::run_threads(c.world_size, [&](int rank) {
      auto pg = new_process_group(c.backend, store, rank, c.world_size, Milliseconds(60'000));
      fn(*pg);
    });
  }
  // Rank r's input: r + 1 + i * 0.5 (exact in float32 for these sizes).
  static torch::Tensor input(int rank, int64_t numel, torch::Dtype dtype = torch::kFloat) {
    return (torch::arange(numel, torch::kDouble) * 0.5 + (rank + 1)).to(dtype);
  }
};

TEST_P(Collectives, AllreduceOps) {
  const Case c = GetParam();
  run([&](ProcessGroup& pg) {
    const int n = pg.size();
    for (auto op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMin, ReduceOp::kMax,
                    ReduceOp::kProduct}) {
      auto t = input(pg.rank(), c.numel, torch::kDouble);
      pg.allreduce(t, {op})->wait();
      auto expected = input(0, c.numel, torch::kDouble);
      for (int r = 1; r < n; ++r) {
        auto x = input(r, c.numel, torch::kDouble);
        if (op == ReduceOp::kSum || op == ReduceOp::kAvg) expected = expected + x;
        if (op == ReduceOp::kMin) expected = torch::minimum(expected, x);
        if (op == ReduceOp::kMax) expected = torch::maximum(expected, x);
        if (op == ReduceOp::kProduct) expected = expected * x;
      }
      if (op == ReduceOp::kAvg) expected = expected / n;
      ASSERT_TRUE(torch::allclose(t, expected, 1e-12, 1e-12)) << to_string(op);
    }
  });
}

TEST_P(Collectives, AllreduceDtypes) {
  const Case c = GetParam();
  run([&](ProcessGroup& pg) {
    const int n = pg.size();
    for (auto dtype : {torch::kFloat, torch::kHalf, torch::kBFloat16, torch::kInt, torch::kLong}) {
      auto t = torch::full({c.numel}, pg.rank() + 1, torch::TensorOptions().dtype(dtype));
      pg.allreduce(t)->wait();
      const double expected = n * (n + 1) / 2.0;
      ASSERT_EQ(t.scalar_type(), dtype);
      ASSERT_TRUE(torch::all(t.to(torch::kDouble) == expected).item<bool>())
          << c10::toString(dtype);
    }
  });
}

TEST_P(Collectives, BroadcastFromEveryRoot) {
  const Case c = GetParam();
  run([&](ProcessGroup& pg) {
    for (int root = 0; root < pg.size(); ++root) {
      auto t = input(pg.rank(), c.numel);
      pg.broadcast(t, {root})->wait();
      ASSERT_TRUE(torch::equal(t, input(root, c.numel)));
    }
  });
}

TEST_P(Collectives, ReduceToRoot) {
  const Case c = GetParam();
  run([&](ProcessGroup& pg) {
    const int root = pg.size() - 1;
    auto t = input(pg.rank(), c.numel);
    pg.reduce(t, {root, ReduceOp::kSum})->wait();
    if (pg.rank() == root) {
      auto expected = torch::zeros({c.numel});
      for (int r = 0; r < pg.size(); ++r) expected += input(r, c.numel);
      ASSERT_TRUE(torch::allclose(t, expected));
    }
  });
}

TEST_P(Collectives, AllgatherGatherScatter) {
  const Case c = GetParam();
  run([&](ProcessGroup& pg) {
    const int n = pg.size();
    std::vector<torch::Tensor> outputs;
    for (int r = 0; r < n; ++r) outputs.push_back(torch::empty({c.numel}));
    pg.allgather(outputs, input(pg.rank(), c.numel))->wait();
    for (int r = 0; r < n; ++r) ASSERT_TRUE(torch::equal(outputs[r], input(r, c.numel)));

    const int root = n / 2;
    std::vector<torch::Tensor> gathered;
    if (pg.rank() == root) {
      for (int r = 0; r < n; ++r) gathered.push_back(torch::empty({c.numel}));
    }
    pg.gather(gathered, input(pg.rank(), c.numel), {root})->wait();
    if (pg.rank() == root) {
      for (int r = 0; r < n; ++r) ASSERT_TRUE(torch::equal(gathered[r], input(r, c.numel)));
    }

    std::vector<torch::Tensor> pieces;
    if (pg.rank() == root) {
      for (int r = 0; r < n; ++r) pieces.push_back(input(r * 10, c.numel));
    }
    auto out = torch::empty({c.numel});
    pg.scatter(out, pieces, {root})->wait();
    ASSERT_TRUE(torch::equal(out, input(pg.rank() * 10, c.numel)));
  });
}

TEST_P(Collectives, ReduceScatter) {
  const Case c = GetParam();
  run([&](ProcessGroup& pg) {
    const int n = pg.size();
    std::vector<torch::Tensor> inputs;
    for (int r = 0; r < n; ++r) inputs.push_back(input(pg.rank() + 7 * r, c.numel));
    auto out = torch::empty({c.numel});
    pg.reduce_scatter(out, inputs)->wait();
    auto expected = torch::zeros({c.numel});
    for (int src = 0; src < n; ++src) expected += input(src + 7 * pg.rank(), c.numel);
    ASSERT_TRUE(torch::allclose(out, expected));
  });
}

TEST_P(Collectives, SendRecvRing) {
  const Case c = GetParam();
  if (c.world_size < 2) GTEST_SKIP() << "point-to-point needs two ranks";
  run([&](ProcessGroup& pg) {
    const int n = pg.size();
    const int next = (pg.rank() + 1) % n;
    const int prev = (pg.rank() + n - 1) % n;
    auto out = input(pg.rank(), c.numel);
    auto in = torch::empty({c.numel});
    auto send = pg.send(out, next, {3});
    auto recv = pg.recv(in, prev, {3});
    send->wait();
    recv->wait();
    ASSERT_TRUE(torch::equal(in, input(prev, c.numel)));
    pg.barrier()->wait();
  });
}

TEST_P(Collectives, SubGroup) {
  const Case c = GetParam();
  run([&](ProcessGroup& pg) {
    std::vector<int> evens;
    for (int r = 0; r < pg.size(); r += 2) evens.push_back(r);
    auto sub = pg.new_group(evens);
    ASSERT_EQ(sub != nullptr, pg.rank() % 2 == 0);
    if (sub) {
      auto t = torch::ones({c.numel});
      sub->allreduce(t)->wait();
      ASSERT_TRUE(torch::all(t == static_cast<double>(evens.size())).item<bool>());
    }
  });
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (const std::string backend : {"gloo", "shm", "hierarchical"}) {
    for (int w = 1; w <= 4; ++w) {
      for (int64_t numel : {0, 1, 1001, 1 << 20}) out.push_back({backend, w, numel});
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Backends, Collectives, ::testing::ValuesIn(cases()), case_name);

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
