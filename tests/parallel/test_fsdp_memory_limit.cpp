// What sharding is for: a model whose DistributedDataParallel replica with Adam's state does not
// fit a per-process memory limit trains under the same limit with FullyShardedDataParallel at
// ZeRO stage 3 on the same two ranks.
//
// Each rank is a forked process that limits its own data segment (RLIMIT_DATA: every private
// writable mapping, heap and anonymous mmap alike, which is what tensors live in) to what it holds
// at its start plus a budget, then builds a Sequential of six 3072 x 3072 Linear layers (57 M
// parameters, 216 MiB of float32) and takes Adam steps. DDP holds the parameters, their
// gradients, the gradient buckets and Adam's two moments and its temporaries; FSDP stage 3 half
// the parameters, their gradients and moments, and a few layers gathered or being reduced.
// The smallest budget each needs, found by halving (SHOAL_TEST_MEMORY_BUDGET_MIB), 2 ranks:
//   Debian's LibTorch 1.13: DDP more than 1400 MiB (its address space grows by 1715 MiB, 1385 MiB
//     resident); FSDP between 800 and 900 MiB (address space +1139 MiB, ~800 MiB resident)
//   PyTorch 2.x's LibTorch: DDP between 1100 and 1200 MiB (+1445 MiB, 1378 MiB resident); FSDP
//     between 700 and 800 MiB (+959 MiB, ~870 MiB resident)
// The budget, 1000 MiB, lies between on both: DDP must fail (an out-of-memory error, or
// killed) and FSDP must finish. RLIMIT_AS would also count the address-space reservations of
// LibTorch and glibc (arenas, thread stacks) that are never touched; a cgroup would do, but
// /sys/fs/cgroup here is the session's own (cgroup v1), not the test's to change.
#include <gtest/gtest.h>
#include <malloc.h>
#include <sys/resource.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>

#include "shoal/comm/init.h"
#include "shoal/comm/store.h"
#include "shoal/error.h"
#include "shoal/parallel/distributed_data_parallel.h"
#include "shoal/parallel/fully_sharded_data_parallel.h"
#include "testing/multi_rank.h"

namespace shoal::parallel {
namespace test_fsdp_memory_limit {

constexpr int64_t kWidth = 3072;
constexpr int kLayers = 6;
constexpr int kSteps = 3;
constexpr int64_t kBatch = 8;
constexpr int64_t kMiB = int64_t{1} << 20;
// Between what FSDP stage 3 and DDP need here (see the file comment).
constexpr int64_t kBudget = 1000 * kMiB;
constexpr std::chrono::milliseconds kTimeout{60'000};

// The budget; SHOAL_TEST_MEMORY_BUDGET_MIB overrides it, to measure what each strategy needs.
int64_t budget() {
  const char* text = std::getenv("SHOAL_TEST_MEMORY_BUDGET_MIB");
  return text != nullptr ? std::atoll(text) * kMiB : kBudget;
}

/// A field of /proc/self/status ("VmData", "VmHWM"), in KiB.
long status_kb(const std::string& field) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.compare(0, field.size() + 1, field + ":") == 0) return std::atol(line.c_str() + field.size() + 1);
  }
  return -1;
}

torch::nn::Sequential make_model() {
  torch::manual_seed(0);
  torch::nn::Sequential model;
  for (int i = 0; i < kLayers; ++i) {
    model->push_back(torch::nn::Linear(kWidth, kWidth));
    if (i + 1 < kLayers) model->push_back(torch::nn::ReLU());
  }
  return model;
}

// One rank of `strategy` ("ddp" or "fsdp") under the budget; prints what it measured and throws
// what went wrong.
void run_rank(const std::string& strategy, int rank, const std::string& store_path) {
  torch::set_num_threads(1);
  // Every block of 1 MiB or more gets its own mapping, returned when freed, for both strategies:
  // the limit then bounds what the tensors hold, not what the C library keeps for reuse (glibc
  // would otherwise keep freed blocks below its dynamic threshold, a different amount for each).
  ::setenv("SHOAL_TUNE_MALLOC", "0", 1);
  ::mallopt(M_MMAP_THRESHOLD, 1 << 20);
  const long start_kb = status_kb("VmData");
  const long start_vm_kb = status_kb("VmSize");
  struct rlimit limit {};
  limit.rlim_cur = limit.rlim_max = static_cast<rlim_t>(start_kb * 1024 + budget());
  SHOAL_CHECK(::setrlimit(RLIMIT_DATA, &limit) == 0, "setrlimit(RLIMIT_DATA) failed");
  auto report = [&](const std::string& what) {
    std::printf("%s rank %d %s data segment %ld MiB at start (limit start + %lld MiB), address "
                "space grew by %ld MiB at its peak, peak resident %ld MiB\n", strategy.c_str(),
                rank, what.c_str(), start_kb / 1024, static_cast<long long>(budget() / kMiB),
                (status_kb("VmPeak") - start_vm_kb) / 1024, status_kb("VmHWM") / 1024);
    std::fflush(stdout);
  };
  try {
    auto store = comm::make_file_store(store_path + "." + strategy, 2, kTimeout);
    auto group = comm::new_process_group("gloo", store, rank, 2, kTimeout);
    auto model = make_model();
    const at::Tensor x = torch::randn({kBatch, kWidth});
    if (strategy == "ddp") {
      DistributedDataParallel ddp(model, group);
      torch::optim::Adam adam(model->parameters(), 1e-3);
      for (int s = 0; s < kSteps; ++s) {
        adam.zero_grad();
        ddp.forward(x).square().mean().backward();
        adam.step();
      }
    } else {
      FullyShardedDataParallelOptions options;
      options.sharding_strategy = ShardingStrategy::kFullShard;
      options.auto_wrap_min_num_params = 1;  // a unit per layer
      FullyShardedDataParallel fsdp(model, group, options);
      torch::optim::Adam adam(fsdp.parameters(), 1e-3);
      for (int s = 0; s < kSteps; ++s) {
        adam.zero_grad();
        fsdp.forward(x).square().mean().backward();
        adam.step();
      }
    }
    report("finished;");
  } catch (const std::exception& e) {
    const std::string what = e.what();
    report("failed (" + what.substr(0, what.find('\n')).substr(0, 200) + ");");
    throw;
  }
}

TEST(FsdpMemoryLimit, Stage3TrainsWhereDdpDoesNotFit) {
  const double params_mib = static_cast<double>(kLayers * (kWidth * kWidth + kWidth) * 4) / kMiB;
  std::printf("model: %d x Linear(%lld, %lld), %.0f MiB of parameters; Adam; per-process "
              "limit: the data segment at start + %lld MiB (RLIMIT_DATA)\n",
              kLayers, static_cast<long long>(kWidth), static_cast<long long>(kWidth), params_mib,
              static_cast<long long>(budget() / kMiB));
  for (const std::string strategy : {"ddp", "fsdp"}) {
    const auto results = shoal::testing::run_processes(
        2,
        [&](int rank, const std::string& store) {
          run_rank(strategy, rank, store);
        },
        std::chrono::milliseconds(240'000));
    bool all_ok = true;
    for (const auto& r : results) {
      all_ok = all_ok && r.ok();
      std::printf("%s rank %d: %s (exit %d, signal %d) %s\n", strategy.c_str(), r.rank,
                  r.ok() ? "finished" : "failed", r.exit_code, r.signal,
                  r.error.substr(0, r.error.find('\n')).substr(0, 160).c_str());
    }
    if (strategy == "ddp") {
      EXPECT_FALSE(all_ok) << "DDP with Adam fit the limit: raise the model or lower kBudget";
    } else {
      EXPECT_TRUE(all_ok) << "FSDP stage 3 did not fit the limit";
    }
  }
}

}  // namespace test_fsdp_memory_limit
}  // namespace shoal::parallel
