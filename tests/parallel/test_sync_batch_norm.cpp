// SyncBatchNorm on 2 ranks (threads) equals BatchNorm over the whole batch in one process:
// output, input gradients, summed weight/bias gradients and running statistics.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "shoal/comm/init.h"
#include "shoal/error.h"
#include "shoal/parallel/sync_batch_norm.h"
#include "testing/multi_rank.h"

namespace shoal::parallel {
namespace {

TEST(SyncBatchNorm, MatchesBatchNormOverTheFullBatch) {
  torch::set_num_threads(1);
  constexpr int kWorld = 2;
  constexpr int64_t kPerRank = 3;
  torch::manual_seed(21);
  auto x = torch::randn({kPerRank * kWorld, 4, 5, 5}) * 2 + 1;
  auto g = torch::randn_like(x);  // the gradient flowing back into the output
  torch::nn::BatchNorm2d bn(4);
  {
    torch::NoGradGuard no_grad;
    bn->weight.uniform_(0.5, 1.5);
    bn->bias.uniform_(-0.5, 0.5);
  }
  auto x_full = x.clone().requires_grad_(true);
  auto out_full = bn(x_full);
  (out_full * g).sum().backward();

  auto store = comm::make_hash_store(std::chrono::milliseconds(30'000));
  std::vector<torch::Tensor> outs(kWorld), grads(kWorld), weight_grads(kWorld), bias_grads(kWorld),
      means(kWorld), vars(kWorld);
  shoal::testing::run_threads(kWorld, [&](int rank) {
    auto group = comm::new_process_group("gloo", store, rank, kWorld);
    auto module = convert_sync_batchnorm(bn.ptr(), group);
    auto sync = std::dynamic_pointer_cast<SyncBatchNormImpl>(module);
    ASSERT_TRUE(sync != nullptr);
    {
      torch::NoGradGuard no_grad;  // the conversion copies BatchNorm's state before its update
      sync->running_mean.zero_();
      sync->running_var.fill_(1);
      sync->num_batches_tracked.zero_();
    }
    auto xr = x.narrow(0, rank * kPerRank, kPerRank).clone().requires_grad_(true);
    auto out = sync->forward(xr);
    (out * g.narrow(0, rank * kPerRank, kPerRank)).sum().backward();
    outs[rank] = out.detach();
    grads[rank] = xr.grad();
    weight_grads[rank] = sync->weight.grad().clone();
    bias_grads[rank] = sync->bias.grad().clone();
    means[rank] = sync->running_mean.clone();
    vars[rank] = sync->running_var.clone();
  });
  EXPECT_TRUE(torch::allclose(torch::cat(outs), out_full.detach(), 1e-4, 1e-5));
  EXPECT_TRUE(torch::allclose(torch::cat(grads), x_full.grad(), 1e-4, 1e-5));
  EXPECT_TRUE(torch::allclose(weight_grads[0] + weight_grads[1], bn->weight.grad(), 1e-4, 1e-5));
  EXPECT_TRUE(torch::allclose(bias_grads[0] + bias_grads[1], bn->bias.grad(), 1e-4, 1e-5));
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_TRUE(torch::allclose(means[r], bn->running_mean, 1e-5, 1e-6));
    EXPECT_TRUE(torch::allclose(vars[r], bn->running_var, 1e-5, 1e-6));
  }
}

// In eval mode SyncBatchNorm is BatchNorm in eval mode: each rank normalises with the running
// statistics alone, communicates nothing (ranks with different batch counts do not wait for each
// other) and leaves the statistics as they were.
TEST(SyncBatchNorm, EvalUsesRunningStatisticsWithoutCommunicating) {
  torch::set_num_threads(1);
  constexpr int kWorld = 2;
  torch::manual_seed(22);
  torch::nn::BatchNorm2d bn(3);
  {
    torch::NoGradGuard no_grad;
    bn->weight.uniform_(0.5, 1.5);
    bn->bias.uniform_(-0.5, 0.5);
    bn->running_mean.uniform_(-1, 1);
    bn->running_var.uniform_(0.5, 2);
  }
  bn->eval();
  std::vector<torch::Tensor> inputs = {torch::randn({2, 3, 4, 4}) * 3, torch::randn({5, 3, 4, 4}) + 2};
  auto store = comm::make_hash_store(std::chrono::milliseconds(30'000));
  std::vector<torch::Tensor> outs(kWorld);
  std::vector<torch::Tensor> means(kWorld), vars(kWorld);
  shoal::testing::run_threads(kWorld, [&](int rank) {
    auto group = comm::new_process_group("gloo", store, rank, kWorld);
    auto sync = std::dynamic_pointer_cast<SyncBatchNormImpl>(convert_sync_batchnorm(bn.ptr(), group));
    ASSERT_TRUE(sync != nullptr);
    sync->eval();
    torch::NoGradGuard no_grad;
    // Rank 1 runs three batches, rank 0 one: with any collective inside, rank 1 would hang.
    for (int i = 0; i < (rank == 0 ? 1 : 3); ++i) outs[rank] = sync->forward(inputs[rank]);
    means[rank] = sync->running_mean.clone();
    vars[rank] = sync->running_var.clone();
  });
  torch::NoGradGuard no_grad;
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_TRUE(torch::allclose(outs[r], bn(inputs[r]), 1e-5, 1e-6)) << "rank " << r;
    EXPECT_TRUE(torch::equal(means[r], bn->running_mean)) << "rank " << r;
    EXPECT_TRUE(torch::equal(vars[r], bn->running_var)) << "rank " << r;
  }
}

TEST(SyncBatchNorm, ConvertsSequentialsAndExplainsCustomModules) {
  auto store = comm::make_hash_store();
  auto group = comm::new_process_group("gloo", store, 0, 1);
  torch::nn::Sequential seq(torch::nn::Linear(3, 4), torch::nn::BatchNorm1d(4), torch::nn::ReLU());
  auto converted = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(
      convert_sync_batchnorm(seq.ptr(), group));
  ASSERT_TRUE(converted != nullptr);
  EXPECT_TRUE(converted->ptr(1)->as<SyncBatchNormImpl>() != nullptr);
  EXPECT_EQ(converted->named_parameters().keys(), seq->named_parameters().keys());
  EXPECT_EQ(converted->forward(torch::randn({5, 3})).sizes(), (std::vector<int64_t>{5, 4}));
  struct NetImpl : torch::nn::Module {
    NetImpl() : bn(register_module("bn", torch::nn::BatchNorm2d(3))) {}
    torch::nn::BatchNorm2d bn;
  };
  EXPECT_THROW(convert_sync_batchnorm(std::make_shared<NetImpl>(), group), InvalidArgument);
}

}  // namespace
}  // namespace shoal::parallel
