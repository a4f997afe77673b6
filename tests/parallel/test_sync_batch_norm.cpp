// SyncBatchNorm on 2 ranks (threads) equals BatchNorm over the whole batch in one process:
// output, input gradients, summed weight/bias gradients and running statistics.
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "shoal/comm/init.h"
#include "shoal/error.h"
#include "shoal/parallel/sync_batch_norm.h"
#include "testing/multi_rank.h"

namespace shoal::parallel {
namespace test_sync_batch_norm {

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

// Largest difference between `actual` and `expected` relative to expected's own magnitude (at
// least 1): each tensor is held to its own scale.
double relative_error(const torch::Tensor& actual, const torch::Tensor& expected) {
  return (actual - expected).abs().max().item<double>() /
         std::max(1.0, expected.abs().max().item<double>());
}

// In float64, to 1e-12: ranks whose inputs have different means (and different batch sizes), so
// the global variance is the ranks' variances plus the variance of their means (the between-rank
// term); output, input gradients, weight and bias gradients and the running statistics after two
// steps equal BatchNorm2d's over the concatenated batch in one process.
TEST(SyncBatchNorm, Float64MatchesBatchNormOverTheConcatenatedBatchWithDifferentRankMeans) {
  torch::set_num_threads(1);
  constexpr int kWorld = 3;
  constexpr int kSteps = 2;
  const int64_t sizes[kWorld] = {2, 3, 5};
  const int64_t offsets[kWorld + 1] = {0, 2, 5, 10};
  auto g = at::make_generator<at::CPUGeneratorImpl>(5);
  std::vector<torch::Tensor> xs, dys;  // per step: the whole batch and the gradient of the output
  for (int step = 0; step < kSteps; ++step) {
    std::vector<torch::Tensor> parts;
    for (int r = 0; r < kWorld; ++r) {
      // Rank r's samples centred on 4 r, with a spread of its own.
      parts.push_back(torch::randn({sizes[r], 3, 2, 3}, g, torch::kDouble) * (1 + r) + 4.0 * r);
    }
    xs.push_back(torch::cat(parts));
    dys.push_back(torch::randn({offsets[kWorld], 3, 2, 3}, g, torch::kDouble));
  }
  torch::nn::BatchNorm2d bn(3);
  bn->to(torch::kDouble);
  {
    torch::NoGradGuard no_grad;
    bn->weight.copy_(torch::rand({3}, g, torch::kDouble) + 0.5);
    bn->bias.copy_(torch::rand({3}, g, torch::kDouble) - 0.5);
  }
  const auto weight0 = bn->weight.detach().clone(), bias0 = bn->bias.detach().clone();
  std::vector<torch::Tensor> out_full, grad_full, weight_grad_full, bias_grad_full;
  for (int step = 0; step < kSteps; ++step) {
    bn->zero_grad();
    auto x = xs[step].clone().requires_grad_(true);
    auto out = bn(x);
    (out * dys[step]).sum().backward();
    out_full.push_back(out.detach());
    grad_full.push_back(x.grad());
    weight_grad_full.push_back(bn->weight.grad().clone());
    bias_grad_full.push_back(bn->bias.grad().clone());
  }

  auto store = comm::make_hash_store(std::chrono::milliseconds(60'000));
  // [rank][step]
  std::vector<std::vector<torch::Tensor>> outs(kWorld), grads(kWorld), weight_grads(kWorld),
      bias_grads(kWorld);
  std::vector<torch::Tensor> means(kWorld), vars(kWorld);
  shoal::testing::run_threads(kWorld, [&](int rank) {
    auto group = comm::new_process_group("gloo", store, rank, kWorld);
    SyncBatchNorm sync(3, group);
    sync->to(torch::kDouble);
    {
      torch::NoGradGuard no_grad;
      sync->weight.copy_(weight0);
      sync->bias.copy_(bias0);
    }
    for (int step = 0; step < kSteps; ++step) {
      sync->zero_grad();
      auto xr = xs[step].narrow(0, offsets[rank], sizes[rank]).clone().requires_grad_(true);
      auto out = sync(xr);
      (out * dys[step].narrow(0, offsets[rank], sizes[rank])).sum().backward();
      outs[rank].push_back(out.detach());
      grads[rank].push_back(xr.grad());
      weight_grads[rank].push_back(sync->weight.grad().clone());
      bias_grads[rank].push_back(sync->bias.grad().clone());
    }
    means[rank] = sync->running_mean.clone();
    vars[rank] = sync->running_var.clone();
  });
  constexpr double kTolerance = 1e-12;
  for (int step = 0; step < kSteps; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    std::vector<torch::Tensor> out_parts, grad_parts;
    auto weight_grad = torch::zeros({3}, torch::kDouble), bias_grad = torch::zeros({3}, torch::kDouble);
    for (int r = 0; r < kWorld; ++r) {
      out_parts.push_back(outs[r][step]);
      grad_parts.push_back(grads[r][step]);
      weight_grad += weight_grads[r][step];
      bias_grad += bias_grads[r][step];
    }
    EXPECT_LE(relative_error(torch::cat(out_parts), out_full[step]), kTolerance) << "output";
    EXPECT_LE(relative_error(torch::cat(grad_parts), grad_full[step]), kTolerance) << "input gradient";
    EXPECT_LE(relative_error(weight_grad, weight_grad_full[step]), kTolerance) << "weight gradient";
    EXPECT_LE(relative_error(bias_grad, bias_grad_full[step]), kTolerance) << "bias gradient";
  }
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_LE(relative_error(means[r], bn->running_mean), kTolerance) << "running_mean, rank " << r;
    EXPECT_LE(relative_error(vars[r], bn->running_var), kTolerance) << "running_var, rank " << r;
  }
}

// Evaluation (running statistics, or without them the local batch's) communicates nothing, as in
// PyTorch: rank 0 evaluates alone, and would wait for rank 1 in any collective.
TEST(SyncBatchNorm, EvaluationDoesNotCommunicate) {
  torch::set_num_threads(1);
  auto store = comm::make_hash_store(std::chrono::milliseconds(30'000));
  torch::manual_seed(4);
  auto x = torch::randn({6, 3}) * 3 + 5;
  shoal::testing::run_threads(
      2,
      [&](int rank) {
        auto group = comm::new_process_group("gloo", store, rank, 2);
        // Rank 1 waits in a barrier while rank 0 evaluates (a collective of rank 0's would meet
        // the barrier and fail the collective check), and does not tear its Gloo pairs down
        // while rank 0 may still be finishing their set-up (seen once under load: "Connection
        // closed by peer" in rank 1's constructor).
        if (rank != 0) {
          group->barrier()->wait();
          return;
        }
        torch::nn::BatchNorm1d tracked(3);
        {
          torch::NoGradGuard no_grad;
          tracked->running_mean.uniform_(-1, 1);
          tracked->running_var.uniform_(0.5, 2);
        }
        tracked->eval();
        auto sync = convert_sync_batchnorm(tracked.ptr(), group);
        sync->eval();
        auto out = std::dynamic_pointer_cast<SyncBatchNormImpl>(sync)->forward(x);
        EXPECT_TRUE(torch::allclose(out, tracked(x), 1e-6, 1e-6));

        torch::nn::BatchNorm1d untracked(torch::nn::BatchNormOptions(3).track_running_stats(false));
        untracked->eval();
        SyncBatchNorm sync_untracked(torch::nn::BatchNormOptions(3).track_running_stats(false),
                                     group);
        sync_untracked->eval();
        EXPECT_TRUE(torch::allclose(sync_untracked(x), untracked(x), 1e-6, 1e-6));
        group->barrier()->wait();
      },
      std::chrono::milliseconds(20'000));
}

// A custom module holding containers that hold BatchNorms at several depths.
struct TreeImpl : torch::nn::Module {
  torch::nn::Sequential head{register_module(
      "head", torch::nn::Sequential(torch::nn::Linear(3, 4), torch::nn::BatchNorm1d(4),
                                    torch::nn::ReLU()))};
  torch::nn::ModuleList blocks{register_module(
      "blocks", torch::nn::ModuleList(torch::nn::BatchNorm2d(2),
                                      torch::nn::Sequential(torch::nn::BatchNorm3d(2))))};
  torch::nn::ModuleDict extra{register_module(
      "extra", torch::nn::ModuleDict(torch::OrderedDict<std::string, std::shared_ptr<Module>>{
                   {"norm", torch::nn::BatchNorm1d(4).ptr()}}))};
};

TEST(SyncBatchNorm, ConvertsBatchNormsAnywhereInContainersAndExplainsTypedMembers) {
  auto store = comm::make_hash_store();
  auto group = comm::new_process_group("gloo", store, 0, 1);
  auto tree = std::make_shared<TreeImpl>();
  {
    torch::NoGradGuard no_grad;
    for (auto& t : tree->parameters()) t.uniform_(-1, 1);
    for (auto& b : tree->buffers()) {
      if (b.is_floating_point()) b.uniform_(0.5, 1.5);
    }
  }
  tree->eval();
  auto params_before = tree->named_parameters();
  auto buffers_before = tree->named_buffers();
  std::vector<torch::Tensor> param_copies, buffer_copies;
  for (const auto& p : params_before) param_copies.push_back(p.value().clone());
  for (const auto& b : buffers_before) buffer_copies.push_back(b.value().clone());

  auto converted = convert_sync_batchnorm(tree, group);
  ASSERT_EQ(converted.get(), tree.get());
  int syncs = 0;
  for (const auto& m : tree->modules()) {
    EXPECT_FALSE(m->as<torch::nn::BatchNorm1dImpl>() || m->as<torch::nn::BatchNorm2dImpl>() ||
                 m->as<torch::nn::BatchNorm3dImpl>());
    if (auto* sync = m->as<SyncBatchNormImpl>()) {
      ++syncs;
      EXPECT_FALSE(sync->is_training()) << "the training mode is kept";
    }
  }
  EXPECT_EQ(syncs, 4);
  // The typed members see the converted layers: the containers changed in place.
  EXPECT_TRUE(tree->head->ptr(1)->as<SyncBatchNormImpl>() != nullptr);
  EXPECT_TRUE(tree->blocks->ptr(0)->as<SyncBatchNormImpl>() != nullptr);
  EXPECT_EQ(tree->named_parameters().keys(), params_before.keys());
  EXPECT_EQ(tree->named_buffers().keys(), buffers_before.keys());
  auto params_after = tree->named_parameters().values();
  auto buffers_after = tree->named_buffers().values();
  for (size_t i = 0; i < param_copies.size(); ++i) {
    EXPECT_TRUE(torch::equal(params_after[i], param_copies[i])) << params_before.keys()[i];
  }
  for (size_t i = 0; i < buffer_copies.size(); ++i) {
    EXPECT_TRUE(torch::equal(buffers_after[i], buffer_copies[i])) << buffers_before.keys()[i];
  }
  EXPECT_EQ(tree->head->forward(torch::randn({5, 3})).sizes(), (std::vector<int64_t>{5, 4}));

  struct NetImpl : torch::nn::Module {
    NetImpl() : bn(register_module("bn", torch::nn::BatchNorm2d(3))) {}
    torch::nn::BatchNorm2d bn;
  };
  try {
    convert_sync_batchnorm(std::make_shared<NetImpl>(), group);
    ADD_FAILURE() << "a typed BatchNorm member was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("'bn'"), std::string::npos) << e.what();
  }
}

}  // namespace test_sync_batch_norm
}  // namespace shoal::parallel
