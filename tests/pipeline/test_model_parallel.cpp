// ModelParallel in one process: the even split by parameter count (exact partitions), placement
// maps, and training: a Sequential split into 2 and 3 parts, with and without micro-batches,
// ends 20 SGD steps with the unsplit model's parameters; state dict names; a failing part.
// Here every "device" is the CPU: placement, the moves between parts and the part threads'
// scheduling are the real ones, only the copies are no-ops.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "shoal/checkpoint/state_dict.h"
#include "shoal/error.h"
#include "shoal/pipeline/model_parallel.h"
#include "parallel/test_models.h"

namespace shoal::pipeline {
namespace test_model_parallel {

using shoal::testing::make_batch;
using shoal::testing::max_relative_difference;
using shoal::testing::train_on_mlp_batches;

constexpr int64_t kSteps = 20;
constexpr double kTolerance = 1e-5;
const at::Device kCpu(at::kCPU);

// 7 children: parameters 672, 0, 1056, 0, 1056, 0, 330.
torch::nn::Sequential make_net(uint64_t seed) {
  torch::manual_seed(seed);
  return torch::nn::Sequential(torch::nn::Linear(20, 32), torch::nn::ReLU(),
                               torch::nn::Linear(32, 32), torch::nn::Tanh(),
                               torch::nn::Linear(32, 32), torch::nn::ReLU(),
                               torch::nn::Linear(32, 10));
}

TEST(BalancedSplit, MinimisesTheLargestPart) {
  EXPECT_EQ(balanced_split({672, 0, 1056, 0, 1056, 0, 330}, 2), (std::vector<size_t>{0, 4}));
  EXPECT_EQ(balanced_split({672, 0, 1056, 0, 1056, 0, 330}, 3), (std::vector<size_t>{0, 2, 4}));
  EXPECT_EQ(balanced_split({1, 1, 1, 1}, 4), (std::vector<size_t>{0, 1, 2, 3}));
  EXPECT_EQ(balanced_split({5, 1, 1, 1, 1, 1}, 2), (std::vector<size_t>{0, 1}));
  EXPECT_THROW(balanced_split({1, 2}, 3), InvalidArgument);
}

struct Case {
  size_t parts;
  int64_t chunks;
};

class ModelParallelTraining : public ::testing::TestWithParam<Case> {};

TEST_P(ModelParallelTraining, EqualsUnsplitModelAfter20Steps) {
  torch::set_num_threads(1);
  const Case c = GetParam();
  auto reference = make_net(3);
  train_on_mlp_batches(reference->parameters(),
                       [&](const torch::Tensor& x) { return reference->forward(x); }, 12, kSteps);

  ModelParallel model(make_net(3), std::vector<at::Device>(c.parts, kCpu),
                      ModelParallelOptions().chunks(c.chunks));
  ASSERT_EQ(model->part_count(), static_cast<int64_t>(c.parts));
  train_on_mlp_batches(model->parameters(),
                       [&](const torch::Tensor& x) { return model->forward(x); }, 12, kSteps);
  EXPECT_LT(max_relative_difference(model->parameters(), reference->parameters()), kTolerance);
}

INSTANTIATE_TEST_SUITE_P(Splits, ModelParallelTraining,
                         ::testing::Values(Case{2, 1}, Case{2, 4}, Case{3, 1}, Case{3, 5}),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return std::to_string(info.param.parts) + "parts_" +
                                  std::to_string(info.param.chunks) + "chunks";
                         });

TEST(ModelParallel, EvenSplitGroupsByParameterCount) {
  ModelParallel model(make_net(1), std::vector<at::Device>(3, kCpu));
  EXPECT_EQ(model->part_names(0), (std::vector<std::string>{"0", "1"}));
  EXPECT_EQ(model->part_names(1), (std::vector<std::string>{"2", "3"}));
  EXPECT_EQ(model->part_names(2), (std::vector<std::string>{"4", "5", "6"}));
}

TEST(ModelParallel, PlacementMapAndStateDictKeys) {
  auto bare = make_net(1);
  std::map<std::string, at::Device> placement;
  for (int i = 0; i < 7; ++i) placement.emplace(std::to_string(i), kCpu);
  ModelParallel model(make_net(1), placement, ModelParallelOptions().chunks(3));
  EXPECT_EQ(model->part_count(), 1);  // consecutive children on one device form one part
  std::vector<std::string> keys, bare_keys;
  for (const auto& item : checkpoint::state_dict(*model)) keys.push_back(item.key());
  for (const auto& item : checkpoint::state_dict(*bare)) bare_keys.push_back(item.key());
  EXPECT_EQ(keys, bare_keys);
  auto [x, y] = make_batch("mlp", 0, 5);
  EXPECT_TRUE(torch::equal(model->forward(x), bare->forward(x)));
  placement.erase("3");
  EXPECT_THROW(ModelParallel(make_net(1), placement), InvalidArgument);
}

TEST(ModelParallel, FailingPartIsNamed) {
  torch::nn::Sequential net(torch::nn::Linear(20, 8), torch::nn::Linear(4, 2));  // shapes clash
  ModelParallel model(net, std::vector<at::Device>(2, kCpu), ModelParallelOptions().chunks(2));
  auto [x, y] = make_batch("mlp", 0, 4);
  try {
    model->forward(x);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("part 1 (cpu, children 1..1) failed in forward"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace test_model_parallel
}  // namespace shoal::pipeline
