// The model registry: shapes, PyTorch parameter names and order, seeding, errors.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "shoal/error.h"
#include "shoal/models/cnn.h"
#include "shoal/models/registry.h"

namespace shoal::models {
namespace test_models {

std::vector<std::string> parameter_names(torch::nn::Module& module) {
  std::vector<std::string> names;
  for (const auto& item : module.named_parameters()) names.push_back(item.key());
  return names;
}

TEST(Models, ListsCnnAndMlp) {
  const std::vector<std::string> names = list_models();
  EXPECT_NE(std::find(names.begin(), names.end(), "cnn"), names.end());
  EXPECT_NE(std::find(names.begin(), names.end(), "mlp"), names.end());
  EXPECT_TRUE(std::is_sorted(names.begin(), names.end()));
}

TEST(Models, EveryModelMapsImagesToTenLogits) {
  torch::NoGradGuard no_grad;
  for (const std::string& name : list_models()) {
    auto model = create(name, 0);
    for (int64_t batch : {1, 5}) {
      const torch::Tensor logits = model->forward(torch::randn({batch, 1, 28, 28}));
      EXPECT_EQ(logits.sizes(), (std::vector<int64_t>{batch, 10})) << name;
      EXPECT_TRUE(torch::isfinite(logits).all().item<bool>()) << name;
    }
  }
}

TEST(Models, CnnHasPyTorchParameterNamesInOrder) {
  auto model = create("cnn", 0);
  EXPECT_EQ(parameter_names(*model),
            (std::vector<std::string>{"conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias",
                                      "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}));
  const auto params = model->named_parameters();
  EXPECT_EQ(params["conv1.weight"].sizes(), (std::vector<int64_t>{32, 1, 3, 3}));
  EXPECT_EQ(params["conv2.weight"].sizes(), (std::vector<int64_t>{64, 32, 3, 3}));
  EXPECT_EQ(params["fc1.weight"].sizes(), (std::vector<int64_t>{128, 9216}));
  EXPECT_EQ(params["fc2.weight"].sizes(), (std::vector<int64_t>{10, 128}));
  // Reachable as the concrete type too, for users who want the submodules.
  EXPECT_NE(std::dynamic_pointer_cast<Cnn>(model), nullptr);
}

TEST(Models, MlpHasPyTorchParameterNamesInOrder) {
  auto model = create("mlp", 0);
  EXPECT_EQ(parameter_names(*model),
            (std::vector<std::string>{"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias",
                                      "fc3.weight", "fc3.bias"}));
  const auto params = model->named_parameters();
  EXPECT_EQ(params["fc1.weight"].sizes(), (std::vector<int64_t>{1024, 784}));
  EXPECT_EQ(params["fc2.weight"].sizes(), (std::vector<int64_t>{1024, 1024}));
  EXPECT_EQ(params["fc3.weight"].sizes(), (std::vector<int64_t>{10, 1024}));
}

TEST(Models, SeedDecidesInitialWeights) {
  for (const std::string& name : list_models()) {
    auto a = create(name, 3), b = create(name, 3), c = create(name, 4);
    const auto pa = a->parameters(), pb = b->parameters(), pc = c->parameters();
    ASSERT_EQ(pa.size(), pc.size());
    bool all_equal_c = true;
    for (size_t i = 0; i < pa.size(); ++i) {
      EXPECT_TRUE(torch::equal(pa[i], pb[i])) << name << " parameter " << i;
      all_equal_c = all_equal_c && torch::equal(pa[i], pc[i]);
    }
    EXPECT_FALSE(all_equal_c) << name << ": seeds 3 and 4 gave the same weights";
  }
}

TEST(Models, CreateLeavesTheGlobalGeneratorAlone) {
  torch::manual_seed(11);
  const torch::Tensor expected = torch::randn({8});
  torch::manual_seed(11);
  create("cnn", 5);
  EXPECT_TRUE(torch::equal(torch::randn({8}), expected));
}

TEST(Models, UnknownNameListsKnownOnes) {
  try {
    create("resnet9000");
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("resnet9000"), std::string::npos) << message;
    EXPECT_NE(message.find("cnn"), std::string::npos) << message;
    EXPECT_NE(message.find("mlp"), std::string::npos) << message;
  }
}

TEST(Models, StateDictRoundTripsByName) {
  // Copying parameters by name between two instances makes their outputs equal: the names are
  // the state-dict keys a PyTorch checkpoint uses.
  auto a = create("cnn", 1), b = create("cnn", 2);
  {
    torch::NoGradGuard no_grad;
    auto target = b->named_parameters();
    for (const auto& item : a->named_parameters()) target[item.key()].copy_(item.value());
  }
  torch::NoGradGuard no_grad;
  const torch::Tensor x = torch::randn({3, 1, 28, 28});
  EXPECT_TRUE(torch::equal(a->forward(x), b->forward(x)));
}

}  // namespace test_models
}  // namespace shoal::models
