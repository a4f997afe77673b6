// DataParallel on CPU slots: K replicas train exactly like one model on the whole batch (the
// gradients of the chunks sum to the batch's), with even and uneven splits and batches smaller
// than K; BatchNorm buffers follow PyTorch's DataParallel (replica 0's updates kept, each replica
// normalising its own chunk), checked against those semantics written out by hand; tuple and
// non-tensor arguments and results, input gradients, a replica that throws, state dict names.
//
// PyTorch's own nn.DataParallel cannot be the oracle here: on a machine without GPUs it runs the
// module alone (device_ids=[]), and its replicate/scatter go through CUDA's comm functions.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <string>
#include <tuple>
#include <vector>

#include "shoal/checkpoint/state_dict.h"
#include "shoal/error.h"
#include "shoal/parallel/data_parallel.h"
#include "test_models.h"

namespace shoal::parallel {
namespace test_data_parallel {

using shoal::testing::clone_all;
using shoal::testing::make_batch;
using shoal::testing::max_relative_difference;
using shoal::testing::train_on_mlp_batches;

constexpr int64_t kSteps = 50;
constexpr double kTolerance = 1e-5;

torch::nn::Sequential make_mlp(uint64_t seed) {
  torch::manual_seed(seed);
  return torch::nn::Sequential(torch::nn::Linear(20, 32), torch::nn::ReLU(),
                               torch::nn::Linear(32, 32), torch::nn::Tanh(),
                               torch::nn::Linear(32, 10));
}

torch::nn::Sequential make_bn_mlp(uint64_t seed) {
  torch::manual_seed(seed);
  return torch::nn::Sequential(torch::nn::Linear(20, 16), torch::nn::BatchNorm1d(16),
                               torch::nn::ReLU(), torch::nn::Linear(16, 10));
}

std::vector<torch::Tensor> state_of(torch::nn::Module& module) {
  std::vector<torch::Tensor> all = clone_all(module.parameters());
  for (const auto& b : module.buffers()) all.push_back(b.detach().clone().to(torch::kFloat));
  return all;
}

DataParallelOptions slots(int k) {
  std::vector<int64_t> ids;
  for (int i = 0; i < k; ++i) ids.push_back(i);
  return DataParallelOptions().device_ids(ids).cuda(false);
}

struct Case {
  int replicas;
  int64_t batch;
};

class DataParallelTraining : public ::testing::TestWithParam<Case> {};

// K replicas (even split, uneven split, batch smaller than K) vs one model on the whole batch.
TEST_P(DataParallelTraining, EqualsSingleModelAfter50Steps) {
  torch::set_num_threads(1);
  const Case c = GetParam();
  auto reference = make_mlp(7);
  train_on_mlp_batches(reference->parameters(),
                       [&](const torch::Tensor& x) { return reference->forward(x); }, c.batch,
                       kSteps);

  auto model = make_mlp(7);
  DataParallel<torch::nn::SequentialImpl> dp(model, slots(c.replicas));
  train_on_mlp_batches(dp.parameters(), [&](const torch::Tensor& x) { return dp.forward(x); },
                       c.batch, kSteps);

  const double diff = max_relative_difference(state_of(*model), state_of(*reference));
  EXPECT_LT(diff, kTolerance) << c.replicas << " replicas, batch " << c.batch;
  const DataParallelStats stats = dp.stats();
  EXPECT_EQ(stats.steps, kSteps);
  EXPECT_EQ(stats.backward_steps, kSteps);
  // The replicas never accumulate gradients of their own: the module's parameters get the sum.
  for (const auto& p : model->parameters()) EXPECT_TRUE(p.grad().defined());
}

INSTANTIATE_TEST_SUITE_P(Splits, DataParallelTraining,
                         ::testing::Values(Case{1, 12}, Case{2, 12}, Case{3, 12}, Case{2, 13},
                                           Case{3, 7}, Case{3, 2}),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return std::to_string(info.param.replicas) + "replicas_batch" +
                                  std::to_string(info.param.batch);
                         });

// One step's gradients of a wide model (the built-in MLP's sizes) over an uneven split.
TEST(DataParallel, GradientsOfAWideModelMatch) {
  torch::set_num_threads(1);
  torch::manual_seed(9);
  torch::nn::Sequential model(torch::nn::Linear(784, 1024), torch::nn::ReLU(),
                              torch::nn::Linear(1024, 1024), torch::nn::ReLU(),
                              torch::nn::Linear(1024, 10));
  auto x = torch::randn({64, 784});
  auto y = torch::randint(0, 10, {64}, torch::kLong);
  torch::nn::functional::cross_entropy(model->forward(x), y).backward();
  std::vector<torch::Tensor> expected;
  for (auto& p : model->parameters()) {
    expected.push_back(p.grad().clone());
    p.mutable_grad().zero_();
  }
  DataParallel<torch::nn::SequentialImpl> dp(model, slots(3));
  torch::nn::functional::cross_entropy(dp.forward(x), y).backward();
  std::vector<torch::Tensor> got;
  for (auto& p : model->parameters()) got.push_back(p.grad());
  EXPECT_LT(max_relative_difference(got, expected), 1e-5);
}

// Tied weights: one parameter registered under two names (as a language model ties its embedding
// and its output layer). LibTorch's parameters() lists it twice; PyTorch's DataParallel (and
// DDP) count it once, so its gradient is that of the plain module, for any replica count, whether
// the replicas keep the tie (a factory that ties) or break it (clone() copies each name apart).
struct TiedImpl : torch::nn::Cloneable<TiedImpl> {
  TiedImpl() { reset(); }
  void reset() override {
    weight = register_parameter("weight", torch::randn({12, 12}) * 0.3);
    register_parameter("weight_tied", weight);
    bias = register_parameter("bias", torch::randn({12}) * 0.1);
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return torch::matmul(torch::tanh(torch::matmul(x, weight) + bias), weight.t());
  }
  torch::Tensor weight, bias;
};
TORCH_MODULE(Tied);

TEST(DataParallel, TiedWeightsGetThePlainModulesGradient) {
  torch::set_num_threads(1);
  torch::manual_seed(5);
  Tied model;
  ASSERT_EQ(model->parameters().size(), 3u);  // LibTorch lists the tied weight twice
  const auto x = torch::randn({12, 12});
  const auto y = torch::randn({12, 12});
  torch::mse_loss(model->forward(x), y).backward();
  const torch::Tensor expected_weight = model->weight.grad().clone();
  const torch::Tensor expected_bias = model->bias.grad().clone();
  const auto check = [&](const char* how, int replicas, DataParallel<TiedImpl>& dp) {
    model->weight.mutable_grad().zero_();
    model->bias.mutable_grad().zero_();
    torch::mse_loss(dp.forward(x), y).backward();
    const double weight_error = max_relative_difference({model->weight.grad()}, {expected_weight});
    const double bias_error = max_relative_difference({model->bias.grad()}, {expected_bias});
    EXPECT_LT(weight_error, 1e-6) << how << ", " << replicas << " replicas: the tied weight's "
                                  << "gradient is " << (model->weight.grad().norm() /
                                                        expected_weight.norm()).item<double>()
                                  << " x the plain module's";
    EXPECT_LT(bias_error, 1e-6) << how << ", " << replicas << " replicas";
  };
  for (int replicas : {1, 2, 3}) {
    DataParallel<TiedImpl> cloned(model.ptr(), slots(replicas));
    check("cloned replicas (tie broken)", replicas, cloned);
    DataParallel<TiedImpl> tied(model.ptr(), slots(replicas),
                                [] { return std::make_shared<TiedImpl>(); });
    check("replicas from a factory (tie kept)", replicas, tied);
  }
}

// A module that is not Cloneable: replicas come from a factory, and the result is the same.
TEST(DataParallel, ReplicaFactoryForNonCloneableModules) {
  torch::set_num_threads(1);
  torch::manual_seed(3);
  shoal::testing::SmallMlp reference;
  torch::manual_seed(3);
  shoal::testing::SmallMlp model;
  train_on_mlp_batches(reference->parameters(),
                       [&](const torch::Tensor& x) { return reference->forward(x); }, 10, 20);
  EXPECT_THROW((DataParallel<shoal::testing::SmallMlpImpl>(model.ptr(), slots(2))), InvalidArgument);
  DataParallel<shoal::testing::SmallMlpImpl> dp(model.ptr(), slots(2), [] {
    return std::make_shared<shoal::testing::SmallMlpImpl>();
  });
  train_on_mlp_batches(dp.parameters(), [&](const torch::Tensor& x) { return dp.forward(x); }, 10,
                       20);
  EXPECT_LT(max_relative_difference(model->parameters(), reference->parameters()), kTolerance);
}

// PyTorch's DataParallel semantics for a model with BatchNorm, written out: replica r normalises
// its own chunk with that chunk's statistics; replica 0 is the module itself (its running
// statistics updates are kept); replicas 1.. are copies of the module made before the step, whose
// buffer updates are discarded; the parameter gradients of all replicas are summed.
void train_bn_oracle(torch::nn::Sequential model, int replicas, int64_t batch) {
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  for (int64_t step = 0; step < kSteps; ++step) {
    auto [x, y] = make_batch("mlp", step, batch);
    auto chunks = x.chunk(replicas, 0);
    std::vector<std::shared_ptr<torch::nn::SequentialImpl>> copies;
    for (size_t r = 1; r < chunks.size(); ++r) {
      copies.push_back(std::dynamic_pointer_cast<torch::nn::SequentialImpl>(model->clone()));
    }
    sgd.zero_grad();
    std::vector<torch::Tensor> outputs{model->forward(chunks[0])};
    for (size_t r = 1; r < chunks.size(); ++r) outputs.push_back(copies[r - 1]->forward(chunks[r]));
    torch::nll_loss(torch::log_softmax(torch::cat(outputs, 0), 1), y).backward();
    const auto params = model->parameters();
    for (const auto& copy : copies) {
      const auto mine = copy->parameters();
      for (size_t i = 0; i < params.size(); ++i) params[i].mutable_grad().add_(mine[i].grad());
    }
    sgd.step();
  }
}

TEST(DataParallel, BatchNormFollowsPytorchSemantics) {
  torch::set_num_threads(1);
  for (int replicas : {1, 2, 3}) {
    auto oracle = make_bn_mlp(11);
    train_bn_oracle(oracle, replicas, 12);
    auto model = make_bn_mlp(11);
    DataParallel<torch::nn::SequentialImpl> dp(model, slots(replicas));
    train_on_mlp_batches(dp.parameters(), [&](const torch::Tensor& x) { return dp.forward(x); },
                         12, kSteps);
    EXPECT_LT(max_relative_difference(state_of(*model), state_of(*oracle)), kTolerance)
        << replicas << " replicas";
    // The running statistics are those of replica 0's chunks: with several replicas they differ
    // from the whole batch's (what the oracle and the model agree on is not trivially equal).
    if (replicas > 1) {
      auto whole = make_bn_mlp(11);
      train_on_mlp_batches(whole->parameters(),
                           [&](const torch::Tensor& x) { return whole->forward(x); }, 12, kSteps);
      EXPECT_GT(max_relative_difference(whole->buffers(), model->buffers()), 1e-3);
    }
    // Evaluation uses the running statistics, in every replica.
    model->eval();
    torch::NoGradGuard no_grad;
    auto [x, y] = make_batch("mlp", 999, 9);
    EXPECT_TRUE(torch::allclose(dp.forward(x), model->forward(x), 1e-6, 1e-6));
  }
}

// A module with several arguments, some not tensors, returning a tuple with a non-tensor.
struct MixedImpl : torch::nn::Cloneable<MixedImpl> {
  MixedImpl() { reset(); }
  void reset() override { fc = register_module("fc", torch::nn::Linear(4, 3)); }
  std::tuple<torch::Tensor, int64_t, std::vector<torch::Tensor>> forward(
      const torch::Tensor& x, double scale, const std::pair<torch::Tensor, std::string>& extra) {
    SHOAL_CHECK(extra.second == "tag", "extra string lost");
    auto h = fc->forward(x) * scale;
    return {h, static_cast<int64_t>(x.size(0)), {h.sum(1, true) + extra.first, extra.first * 2}};
  }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(Mixed);

TEST(DataParallel, TupleAndNonTensorArgumentsAndResults) {
  torch::set_num_threads(1);
  torch::manual_seed(5);
  Mixed model;
  DataParallel<MixedImpl> dp(model.ptr(), slots(3));
  auto x = torch::randn({8, 4}).requires_grad_();
  auto e = torch::randn({8, 1});
  auto [h, rows, list] = dp.forward(x, 0.5, std::make_pair(e, std::string("tag")));
  auto [h0, rows0, list0] = model->forward(x, 0.5, std::make_pair(e, std::string("tag")));
  EXPECT_TRUE(torch::allclose(h, h0));
  EXPECT_EQ(rows, 3);  // replica 0's value: its chunk of 8 over 3 has 3 rows
  ASSERT_EQ(list.size(), 2u);
  EXPECT_TRUE(torch::allclose(list[0], list0[0]));
  EXPECT_TRUE(torch::allclose(list[1], list0[1]));
  // Gradients reach the scattered input and the parameters, equal to the module's own.
  (h.square().sum() + list[0].sum()).backward();
  auto dx = x.grad().clone();
  auto dw = model->fc->weight.grad().clone();
  x.mutable_grad().zero_();
  model->fc->weight.mutable_grad().zero_();
  (h0.square().sum() + list0[0].sum()).backward();
  EXPECT_TRUE(torch::allclose(dx, x.grad(), 1e-5, 1e-6));
  EXPECT_TRUE(torch::allclose(dw, model->fc->weight.grad(), 1e-5, 1e-6));
}

// A per-replica scalar (a loss computed inside the module) gathers into one value per replica.
struct LossImpl : torch::nn::Cloneable<LossImpl> {
  LossImpl() { reset(); }
  void reset() override { fc = register_module("fc", torch::nn::Linear(20, 1)); }
  torch::Tensor forward(const torch::Tensor& x) { return fc->forward(x).square().sum(); }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(Loss);

TEST(DataParallel, ScalarOutputsAreStacked) {
  torch::set_num_threads(1);
  Loss model;
  DataParallel<LossImpl> dp(model.ptr(), slots(2));
  auto [x, y] = make_batch("mlp", 0, 6);
  auto losses = dp.forward(x);
  ASSERT_EQ(losses.sizes().vec(), (std::vector<int64_t>{2}));
  EXPECT_TRUE(torch::allclose(losses[0], model->forward(x.slice(0, 0, 3))));
  EXPECT_TRUE(torch::allclose(losses[1], model->forward(x.slice(0, 3, 6))));
  losses.sum().backward();
  auto grad = model->fc->weight.grad().clone();
  model->fc->weight.mutable_grad().zero_();
  model->forward(x).backward();
  EXPECT_TRUE(torch::allclose(grad, model->fc->weight.grad(), 1e-5, 1e-6));
}

// Throws when its chunk holds a marked row: only the replica that receives the row fails.
struct ThrowerImpl : torch::nn::Cloneable<ThrowerImpl> {
  ThrowerImpl() { reset(); }
  void reset() override { fc = register_module("fc", torch::nn::Linear(20, 10)); }
  torch::Tensor forward(const torch::Tensor& x) {
    if ((x < -1000).any().item<bool>()) throw std::runtime_error("marked row seen");
    return fc->forward(x);
  }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(Thrower);

TEST(DataParallel, ReplicaErrorIsRethrownNamingTheReplica) {
  torch::set_num_threads(1);
  Thrower model;
  DataParallel<ThrowerImpl> dp(model.ptr(), slots(3));
  auto [x, y] = make_batch("mlp", 0, 9);
  auto bad = x.clone();
  bad[7][0] = -5000;  // rows 6..8 go to replica 2
  try {
    dp.forward(bad);
    FAIL() << "no error";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("replica 2 (cpu slot 2) failed in forward"), std::string::npos) << what;
    EXPECT_NE(what.find("marked row seen"), std::string::npos) << what;
  }
  // The wrapper still works afterwards, and trains as the module does.
  auto out = dp.forward(x);
  EXPECT_TRUE(torch::allclose(out, model->forward(x), 1e-6, 1e-6));
  torch::nn::functional::cross_entropy(out, y).backward();
  EXPECT_TRUE(model->fc->weight.grad().defined());
}

TEST(DataParallel, StateDictKeysAreTheModulesOwn) {
  torch::set_num_threads(1);
  auto model = make_bn_mlp(1);
  DataParallel<torch::nn::SequentialImpl> dp(model, slots(2));
  train_on_mlp_batches(dp.parameters(), [&](const torch::Tensor& x) { return dp.forward(x); }, 8,
                       3);
  auto bare = make_bn_mlp(2);
  std::vector<std::string> keys, bare_keys;
  for (const auto& item : dp.named_parameters()) keys.push_back(item.key());
  for (const auto& item : dp.named_buffers()) keys.push_back(item.key());
  for (const auto& item : checkpoint::state_dict(*bare)) bare_keys.push_back(item.key());
  std::sort(keys.begin(), keys.end());
  std::sort(bare_keys.begin(), bare_keys.end());
  EXPECT_EQ(keys, bare_keys);
  EXPECT_EQ(keys.size(), 9u);  // 2 Linear x 2, BatchNorm's weight, bias and 3 buffers
  // The wrapper's module state loads into a bare module, which then computes the same.
  checkpoint::load_state_dict(*bare, checkpoint::state_dict(*dp.module()));
  bare->eval();
  model->eval();
  auto [x, y] = make_batch("mlp", 0, 5);
  torch::NoGradGuard no_grad;
  EXPECT_TRUE(torch::allclose(bare->forward(x), dp.forward(x), 1e-6, 1e-6));
}

TEST(DataParallel, RejectsMismatchedInputs) {
  auto model = make_mlp(1);
  DataParallel<torch::nn::SequentialImpl> dp(model, slots(2));
  EXPECT_THROW(dp.forward(torch::zeros({0, 20})), InvalidArgument);
  EXPECT_THROW((DataParallel<torch::nn::SequentialImpl>(model, slots(1).device_ids({0, 0}))),
               InvalidArgument);
}

}  // namespace test_data_parallel
}  // namespace shoal::parallel
