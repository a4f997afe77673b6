// SyntheticDataset: deterministic per seed, different across seeds, labels in range and learnable
// structure (a linear teacher), shapes as configured.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "shoal/data/synthetic_dataset.h"
#include "shoal/error.h"

namespace shoal::data {
namespace test_synthetic_dataset {

TEST(SyntheticDataset, SameSeedSameData) {
  SyntheticOptions options;
  options.size = 256;
  options.seed = 7;
  torch::manual_seed(1);
  SyntheticDataset a(options);
  torch::manual_seed(2);  // the global generator must not matter
  SyntheticDataset b(options);
  EXPECT_TRUE(torch::equal(a.images(), b.images()));
  EXPECT_TRUE(torch::equal(a.targets(), b.targets()));
}

TEST(SyntheticDataset, DifferentSeedDifferentData) {
  SyntheticOptions options;
  options.size = 256;
  options.seed = 1;
  SyntheticDataset a(options);
  options.seed = 2;
  SyntheticDataset b(options);
  EXPECT_FALSE(torch::equal(a.images(), b.images()));
  EXPECT_FALSE(torch::equal(a.targets(), b.targets()));
}

TEST(SyntheticDataset, ShapesAndLabels) {
  SyntheticOptions options;
  options.size = 500;
  options.sample_shape = {3, 4};
  options.num_classes = 5;
  SyntheticDataset data(options);
  EXPECT_EQ(data.size().value(), 500u);
  EXPECT_EQ(data.images().sizes(), (std::vector<int64_t>{500, 3, 4}));
  EXPECT_EQ(data.targets().sizes(), (std::vector<int64_t>{500}));
  EXPECT_EQ(data.targets().scalar_type(), torch::kLong);
  EXPECT_GE(data.targets().min().item<int64_t>(), 0);
  EXPECT_LT(data.targets().max().item<int64_t>(), 5);
  // A random teacher uses every class on 500 samples (each class has probability ~1/5).
  EXPECT_EQ(torch::bincount(data.targets()).gt(0).sum().item<int64_t>(), 5);
  const auto example = data.get(42);
  EXPECT_TRUE(torch::equal(example.data, data.images()[42]));
  EXPECT_EQ(example.target.item<int64_t>(), data.targets()[42].item<int64_t>());
  EXPECT_THROW(data.get(500), InvalidArgument);
}

TEST(SyntheticDataset, DefaultsLookLikeFashionMnist) {
  SyntheticDataset data;
  EXPECT_EQ(data.images().sizes(), (std::vector<int64_t>{1024, 1, 28, 28}));
  EXPECT_LT(data.targets().max().item<int64_t>(), 10);
}

TEST(SyntheticDataset, LabelsComeFromALinearTeacher) {
  // If labels are a linear function of the input, least squares on one-hot targets separates
  // the training samples far better than chance.
  SyntheticOptions options;
  options.size = 2000;
  options.sample_shape = {20};
  options.num_classes = 4;
  SyntheticDataset data(options);
  const torch::Tensor x = data.images().to(torch::kDouble);
  const torch::Tensor y = torch::one_hot(data.targets(), 4).to(torch::kDouble);
  const torch::Tensor w = std::get<0>(torch::linalg_lstsq(x, y));
  const double accuracy = x.mm(w).argmax(1).eq(data.targets()).to(torch::kDouble).mean().item<double>();
  EXPECT_GT(accuracy, 0.7);
}

TEST(SyntheticDataset, RejectsBadOptions) {
  SyntheticOptions options;
  options.num_classes = 0;
  EXPECT_THROW(SyntheticDataset{options}, InvalidArgument);
  options = {};
  options.size = -1;
  EXPECT_THROW(SyntheticDataset{options}, InvalidArgument);
}

}  // namespace test_synthetic_dataset
}  // namespace shoal::data
