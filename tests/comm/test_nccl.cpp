// The nccl backend (c10d's ProcessGroupNCCL behind compat/), and FullyShardedDataParallel's stages
// over it. Built on every leg; without NCCL in the build, or without a GPU, the GPU tests are
// skipped and the program exits 77 (CTest: skipped) after checking what can be checked on CPU:
// that asking for nccl fails with a clear error, and the FSDP check itself over gloo.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <utility>
#include <vector>

#include "shoal/comm/init.h"
#include "shoal/comm/store.h"
#include "shoal/error.h"
#include "shoal/parallel/distributed_data_parallel.h"
#include "shoal/parallel/fully_sharded_data_parallel.h"
#include "testing/multi_rank.h"

namespace {

using shoal::comm::Milliseconds;

// CUDA is not initialised in this (parent) process, so that the forked ranks may use it: a
// forked child counts the GPUs and reports through a file.
int count_gpus() {
  const std::string path = shoal::testing::temp_path("gpus");
  shoal::testing::ChildProcess probe([&] {
    std::ofstream(path) << (torch::cuda::is_available() ? torch::cuda::device_count() : 0);
  });
  if (!probe.wait(Milliseconds(60'000)) || !probe.result().ok()) return 0;
  int count = 0;
  std::ifstream(path) >> count;
  std::remove(path.c_str());
  return count;
}

const int kGpus = shoal::comm::is_backend_available("nccl") ? count_gpus() : 0;

TEST(Nccl, WithoutGpuOrNcclTheErrorSaysWhatToUse) {
  if (kGpus > 0) GTEST_SKIP() << "this machine has a GPU";
  auto store = shoal::comm::make_hash_store(Milliseconds(5'000));
  try {
    shoal::comm::new_process_group("nccl", store, 0, 1, Milliseconds(5'000));
    FAIL() << "expected an error";
  } catch (const shoal::InvalidArgument& e) {
    const std::string what = e.what();
    EXPECT_TRUE(what.find("gloo") != std::string::npos) << what;
    EXPECT_TRUE(what.find(shoal::comm::is_backend_available("nccl") ? "no CUDA GPU"
                                                                    : "not built in") !=
                std::string::npos)
        << what;
  }
}

// Every rank r contributes (r + 1) * [1, 2, ..., n]: sums, averages, gathers and blocks of the
// reduce-scatter are known exactly (small integers in float32).
// `backend`: nccl; shm or gloo (CUDA tensors staged through pinned host memory, so several ranks
// may share one GPU); cpu:shm,cuda:nccl (the multi-device group `auto` builds with a GPU).
void check_collectives(int rank, int world, const std::string& store_path,
                       const std::string& backend = "nccl") {
  auto store = shoal::comm::make_file_store(store_path, world, Milliseconds(60'000));
  auto pg = shoal::comm::new_process_group(backend, store, rank, world, Milliseconds(60'000));
  SHOAL_CHECK(pg->backend_name() == backend, "backend is ", pg->backend_name());
  const auto cuda =
      torch::TensorOptions().dtype(torch::kFloat).device(torch::kCUDA, rank % kGpus);
  const int64_t n = 1000 * world;
  const auto base = torch::arange(1, n + 1, cuda);
  const double tri = world * (world + 1) / 2.0;  // sum of (r + 1)

  auto t = base * (rank + 1);
  pg->allreduce(t)->wait();
  SHOAL_CHECK(torch::equal(t.cpu(), (base * tri).cpu()), "rank ", rank, ": allreduce sum");

  t = base * (rank + 1);
  shoal::comm::AllreduceOptions avg;
  avg.op = shoal::comm::ReduceOp::kAvg;
  pg->allreduce(t, avg)->wait();
  SHOAL_CHECK(torch::allclose(t.cpu(), (base * tri / world).cpu()), "rank ", rank,
              ": allreduce avg");

  t = rank == 0 ? base.clone() : torch::zeros_like(base);
  pg->broadcast(t)->wait();
  SHOAL_CHECK(torch::equal(t.cpu(), base.cpu()), "rank ", rank, ": broadcast");

  std::vector<at::Tensor> gathered;
  for (int r = 0; r < world; ++r) gathered.push_back(torch::empty_like(base));
  pg->allgather(gathered, base * (rank + 1))->wait();
  for (int r = 0; r < world; ++r) {
    SHOAL_CHECK(torch::equal(gathered[r].cpu(), (base * (r + 1)).cpu()), "rank ", rank,
                ": allgather block ", r);
  }

  // In place (the input this rank's own block of the output), as FSDP's stages 1-2 gather.
  auto full = torch::zeros({n * world}, cuda);
  full.narrow(0, rank * n, n).copy_(base * (rank + 1));
  pg->all_gather_into_tensor(full, full.narrow(0, rank * n, n))->wait();
  for (int r = 0; r < world; ++r) {
    SHOAL_CHECK(torch::equal(full.narrow(0, r * n, n).cpu(), (base * (r + 1)).cpu()), "rank ",
                rank, ": all_gather_into_tensor in place, block ", r);
  }

  std::vector<at::Tensor> blocks = (base * (rank + 1)).chunk(world);
  for (auto& b : blocks) b = b.contiguous();
  auto mine = torch::empty_like(blocks[0]);
  pg->reduce_scatter(mine, blocks)->wait();
  SHOAL_CHECK(torch::equal(mine.cpu(), (base.chunk(world)[rank] * tri).cpu()), "rank ", rank,
              ": reduce_scatter");

  pg->barrier()->wait();

  auto on_cpu = torch::ones({4});
  if (backend != "nccl") {  // host backends and the multi-device group take CPU tensors as well
    pg->allreduce(on_cpu)->wait();
    SHOAL_CHECK(torch::equal(on_cpu, torch::full({4}, static_cast<float>(world))), "rank ", rank,
                ": CPU allreduce on ", backend);
    return;
  }
  try {
    pg->allreduce(on_cpu);
    SHOAL_THROW(shoal::Error, "rank ", rank, ": a CPU tensor was accepted");
  } catch (const shoal::InvalidArgument& e) {
    SHOAL_CHECK(std::string(e.what()).find("CUDA tensors only") != std::string::npos, e.what());
  }
}

// FullyShardedDataParallel's three stages over NCCL, each rank's model on its GPU: the weights
// after a few SGD-momentum steps equal DDP's over the same group (uneven sizes: 12x10 + 10 is not
// a multiple of every world size, so the shards are padded).
std::vector<at::Tensor> train_on(const torch::Device& device, int stage, int rank, int world,
                                 const std::shared_ptr<shoal::comm::ProcessGroup>& pg) {
  torch::manual_seed(0);
  torch::nn::Sequential model(torch::nn::Linear(12, 10), torch::nn::ReLU(),
                              torch::nn::Linear(10, 7), torch::nn::ReLU(), torch::nn::Linear(7, 3));
  model->to(device);
  auto batch = [&](int step) {
    auto generator = at::make_generator<at::CPUGeneratorImpl>(100 + step);
    auto x = torch::randn({4 * world, 12}, generator).narrow(0, 4 * rank, 4).to(device);
    auto y = torch::randint(0, 3, {4 * world}, generator).narrow(0, 4 * rank, 4).to(device);
    return std::make_pair(x, y);
  };
  const auto sgd = torch::optim::SGDOptions(0.1).momentum(0.9);
  if (stage == 0) {
    shoal::parallel::DistributedDataParallel ddp(model, pg);
    torch::optim::SGD optimizer(model->parameters(), sgd);
    for (int step = 0; step < 5; ++step) {
      auto [x, y] = batch(step);
      optimizer.zero_grad();
      torch::nn::functional::cross_entropy(ddp.forward(x), y).backward();
      optimizer.step();
    }
  } else {
    shoal::parallel::FullyShardedDataParallelOptions options;
    options.sharding_strategy = shoal::parallel::sharding_strategy_from_stage(stage);
    options.auto_wrap_min_num_params = 60;  // the first two Linears units, the last the root's
    shoal::parallel::FullyShardedDataParallel fsdp(model, pg, options);
    torch::optim::SGD optimizer(fsdp.parameters(), sgd);
    for (int step = 0; step < 5; ++step) {
      auto [x, y] = batch(step);
      optimizer.zero_grad();
      torch::nn::functional::cross_entropy(fsdp.forward(x), y).backward();
      optimizer.step();
    }
    fsdp.gather_full_parameters();
  }
  std::vector<at::Tensor> weights;
  for (const auto& p : model->parameters()) weights.push_back(p.detach().cpu().clone());
  return weights;
}

// `backend` nccl: each rank on its GPU; gloo: on the CPU (the check itself, on any machine).
void check_fsdp(int rank, int world, const std::string& store_path, const std::string& backend) {
  auto store = shoal::comm::make_file_store(store_path, world, Milliseconds(60'000));
  auto pg = shoal::comm::new_process_group(backend, store, rank, world, Milliseconds(60'000));
  const torch::Device device = backend == "nccl" ? torch::Device(torch::kCUDA, rank % kGpus)
                                                 : torch::Device(torch::kCPU);
  const auto ddp = train_on(device, 0, rank, world, pg);
  for (int stage : {1, 2, 3}) {
    const auto fsdp = train_on(device, stage, rank, world, pg);
    SHOAL_CHECK(fsdp.size() == ddp.size(), "rank ", rank, ": stage ", stage, " has ",
                fsdp.size(), " parameters, DDP ", ddp.size());
    for (size_t i = 0; i < ddp.size(); ++i) {
      const double scale = std::max(ddp[i].abs().max().item<double>(), 1e-12);
      const double difference = (fsdp[i] - ddp[i]).abs().max().item<double>() / scale;
      SHOAL_CHECK(difference < 1e-5, "rank ", rank, ": stage ", stage, " parameter ", i,
                  " differs from DDP's by ", difference, " (relative)");
    }
  }
}

TEST(Nccl, FsdpStagesEqualDdpOnOneGpuPerProcess) {
  if (kGpus == 0) GTEST_SKIP() << "no GPU";
  const int world = std::min(kGpus, 4);
  auto results = shoal::testing::run_processes(
      world, [&](int rank, const std::string& path) { check_fsdp(rank, world, path, "nccl"); },
      Milliseconds(180'000));
  for (const auto& r : results) {
    EXPECT_TRUE(r.ok()) << "rank " << r.rank << " exit " << r.exit_code << ": " << r.error;
  }
}

// The same check on the CPU over gloo, on every machine: a failure of the GPU case above is then
// the GPU's, not the check's.
TEST(Nccl, FsdpCheckItselfOnTheCpu) {
  for (int world : {2, 3}) {
    auto results = shoal::testing::run_processes(
        world, [&](int rank, const std::string& path) { check_fsdp(rank, world, path, "gloo"); },
        Milliseconds(180'000));
    for (const auto& r : results) {
      EXPECT_TRUE(r.ok()) << "world " << world << " rank " << r.rank << " exit " << r.exit_code
                          << ": " << r.error;
    }
  }
}

TEST(Nccl, CollectivesOnOneGpuPerProcess) {
  if (kGpus == 0) GTEST_SKIP() << "no GPU";
  const int world = std::min(kGpus, 4);
  auto results = shoal::testing::run_processes(
      world, [&](int rank, const std::string& path) { check_collectives(rank, world, path); },
      Milliseconds(180'000));
  for (const auto& r : results) {
    EXPECT_TRUE(r.ok()) << "rank " << r.rank << " exit " << r.exit_code << ": " << r.error;
  }
}

// shm and gloo on CUDA tensors: staged through pinned host memory, results back on the device.
TEST(Nccl, HostBackendsStageCudaTensors) {
  if (kGpus == 0) GTEST_SKIP() << "no GPU";
  for (const std::string backend : {"shm", "gloo"}) {
    auto results = shoal::testing::run_processes(
        2, [&](int rank, const std::string& path) { check_collectives(rank, 2, path, backend); },
        Milliseconds(180'000));
    for (const auto& r : results) {
      EXPECT_TRUE(r.ok()) << backend << " rank " << r.rank << " exit " << r.exit_code << ": "
                          << r.error;
    }
  }
}

// The group `--backend auto` builds with a GPU: CUDA tensors to NCCL, CPU tensors to shm.
TEST(Nccl, MultiDeviceGroupSendsEachTensorToItsBackend) {
  if (kGpus == 0) GTEST_SKIP() << "no GPU";
  const int world = std::min(kGpus, 4);
  auto results = shoal::testing::run_processes(
      world,
      [&](int rank, const std::string& path) {
        check_collectives(rank, world, path, "cpu:shm,cuda:nccl");
      },
      Milliseconds(180'000));
  for (const auto& r : results) {
    EXPECT_TRUE(r.ok()) << "rank " << r.rank << " exit " << r.exit_code << ": " << r.error;
  }
}

// Ranks that pass a CPU tensor and a CUDA tensor to the same collective of a multi-device group
// would wait on different backends until the time-out: the collective check compares the device
// type and every rank fails at once, naming the other's device. (cuda:gloo, so that two ranks can
// share one GPU.)
TEST(Nccl, MultiDeviceGroupRefusesRanksThatDisagreeOnTheDevice) {
  if (kGpus == 0) GTEST_SKIP() << "no GPU";
  auto results = shoal::testing::run_processes(
      2,
      [&](int rank, const std::string& path) {
        auto store = shoal::comm::make_file_store(path, 2, Milliseconds(60'000));
        auto pg = shoal::comm::new_process_group("cpu:shm,cuda:gloo", store, rank, 2,
                                                 Milliseconds(60'000));
        pg->set_check_collectives(true);  // as SHOAL_DEBUG=detail would
        auto t = rank == 0 ? torch::ones({256}) : torch::ones({256}, torch::kCUDA);
        const auto start = std::chrono::steady_clock::now();
        try {
          pg->allreduce(t)->wait();
          SHOAL_THROW(shoal::Error, "rank ", rank, ": the mismatch was not caught");
        } catch (const shoal::PeerError& e) {
          const std::string what = e.what();
          SHOAL_CHECK(what.find("does not match rank") != std::string::npos, what);
          SHOAL_CHECK(what.find("on cuda") != std::string::npos, what);
        }
        SHOAL_CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(30),
                    "rank ", rank, ": the mismatch took the time-out to be found");
      },
      Milliseconds(180'000));
  for (const auto& r : results) {
    EXPECT_TRUE(r.ok()) << "rank " << r.rank << " exit " << r.exit_code << ": " << r.error;
  }
}

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  const int failed = RUN_ALL_TESTS();
  if (failed != 0) return failed;
  // The GPU tests did not run: report the program as skipped.
  return kGpus == 0 ? shoal::testing::kSkipExitCode : 0;
}
