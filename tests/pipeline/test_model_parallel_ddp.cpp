// Model parallel x DDP (PyTorch's "DDP with model parallel"): each of 2 forked ranks holds the
// model split in 2 parts (micro-batched, one thread per part) wrapped in DistributedDataParallel
// (no device_ids: the module spans devices); after 20 steps on its half of each global batch,
// every rank holds what one unsplit model trained on the global batch holds.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "shoal/comm/init.h"
#include "shoal/comm/store.h"
#include "shoal/error.h"
#include "shoal/parallel/distributed_data_parallel.h"
#include "shoal/pipeline/model_parallel.h"
#include "parallel/test_models.h"
#include "testing/multi_rank.h"

namespace shoal::pipeline {
namespace test_model_parallel_ddp {

using shoal::testing::make_batch;
using shoal::testing::max_relative_difference;
using Milliseconds = std::chrono::milliseconds;

constexpr int kWorld = 2;
constexpr int64_t kSteps = 20;
constexpr int64_t kGlobalBatch = 12;
constexpr Milliseconds kTimeout{60'000};

torch::nn::Sequential make_net(uint64_t seed) {
  torch::manual_seed(seed);
  return torch::nn::Sequential(torch::nn::Linear(20, 32), torch::nn::ReLU(),
                               torch::nn::Linear(32, 32), torch::nn::Tanh(),
                               torch::nn::Linear(32, 10));
}


void rank_main(int rank, const std::string& store_path, const std::string& backend) {
  torch::set_num_threads(1);
  auto store = comm::make_file_store(store_path, kWorld, kTimeout);
  auto group = comm::new_process_group(backend, store, rank, kWorld, kTimeout);

  auto reference = make_net(5);
  // Different initial weights on rank 1: DDP must broadcast rank 0's.
  ModelParallel model(make_net(5 + rank), std::vector<at::Device>(2, at::Device(at::kCPU)),
                      ModelParallelOptions().chunks(2));
  parallel::DistributedDataParallel<ModelParallelImpl> ddp(model.ptr(), group);
  SHOAL_CHECK(model->part_count() == 2, "expected 2 parts");

  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  torch::optim::SGD sgd_ref(reference->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  const int64_t per_rank = kGlobalBatch / kWorld;
  for (int64_t step = 0; step < kSteps; ++step) {
    auto [x, y] = make_batch("mlp", step, kGlobalBatch);
    sgd_ref.zero_grad();
    torch::nll_loss(torch::log_softmax(reference->forward(x), 1), y).backward();
    sgd_ref.step();

    auto mine = x.slice(0, rank * per_rank, (rank + 1) * per_rank);
    auto labels = y.slice(0, rank * per_rank, (rank + 1) * per_rank);
    sgd.zero_grad();
    torch::nll_loss(torch::log_softmax(ddp.forward(mine), 1), labels).backward();
    sgd.step();
  }
  const double diff = max_relative_difference(model->parameters(), reference->parameters());
  SHOAL_CHECK(diff < 1e-5, "rank ", rank, ": parameters differ from single-process training by ",
              diff, " (relative)");
}

class ModelParallelDdp : public ::testing::TestWithParam<std::string> {};

TEST_P(ModelParallelDdp, TwoRanksEqualSingleProcessWithGlobalBatch) {
  const std::string backend = GetParam();
  auto results = shoal::testing::run_processes(
      kWorld, [&](int rank, const std::string& store) { rank_main(rank, store, backend); },
      Milliseconds(90'000));
  for (const auto& r : results) EXPECT_TRUE(r.ok()) << "rank " << r.rank << ": " << r.error;
}

INSTANTIATE_TEST_SUITE_P(Backends, ModelParallelDdp, ::testing::Values("gloo", "shm"));

}  // namespace test_model_parallel_ddp
}  // namespace shoal::pipeline
