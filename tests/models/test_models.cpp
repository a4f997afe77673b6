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

TEST(Models, EveryImageModelMapsImagesToTenLogits) {
  torch::NoGradGuard no_grad;
  for (const std::string& name : list_models()) {
    if (!needs_input_shape(name)) continue;  // the GPT takes token ids (below)
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

GptConfig tiny_gpt() {
  GptConfig config;
  config.n_layer = 2;
  config.n_head = 2;
  config.n_embd = 16;
  config.block_size = 8;
  config.vocab_size = 32;
  return config;
}

TEST(Gpt, HasNanoGptParameterNamesAndATiedHead) {
  ModelOptions options;
  options.gpt = tiny_gpt();
  auto model = create("gpt", 0, options);
  const std::vector<std::string> names = parameter_names(*model);
  const std::vector<std::string> first{"transformer.wte.weight", "transformer.wpe.weight",
                                       "transformer.h.0.ln_1.weight", "transformer.h.0.ln_1.bias",
                                       "transformer.h.0.attn.c_attn.weight",
                                       "transformer.h.0.attn.c_attn.bias",
                                       "transformer.h.0.attn.c_proj.weight"};
  ASSERT_GE(names.size(), first.size());
  EXPECT_EQ(std::vector<std::string>(names.begin(), names.begin() + first.size()), first);
  EXPECT_EQ(names.back(), "lm_head.weight");
  const auto params = model->named_parameters();
  EXPECT_TRUE(params["lm_head.weight"].is_same(params["transformer.wte.weight"]));
  EXPECT_EQ(params["transformer.h.1.mlp.c_fc.weight"].sizes(), (std::vector<int64_t>{64, 16}));
  EXPECT_FALSE(needs_input_shape("gpt"));
}

TEST(Gpt, ForwardIsCausalAndTheLossIsCrossEntropy) {
  ModelOptions options;
  options.gpt = tiny_gpt();
  auto model = create("gpt", 1, options);
  ASSERT_TRUE(model->owns_loss());
  torch::NoGradGuard no_grad;
  const torch::Tensor idx = torch::randint(0, 32, {3, 8}, torch::kLong);
  const torch::Tensor logits = model->forward(idx);
  EXPECT_EQ(logits.sizes(), (std::vector<int64_t>{3, 8, 32}));
  // Changing the last token changes no earlier position's logits.
  torch::Tensor changed = idx.clone();
  changed.select(1, 7).add_(1).remainder_(32);
  const torch::Tensor again = model->forward(changed);
  EXPECT_TRUE(torch::allclose(logits.slice(1, 0, 7), again.slice(1, 0, 7)));
  EXPECT_FALSE(torch::allclose(logits.select(1, 7), again.select(1, 7)));
  const torch::Tensor targets = torch::randint(0, 32, {3, 8}, torch::kLong);
  const torch::Tensor expected = torch::nn::functional::cross_entropy(logits.reshape({-1, 32}),
                                                                      targets.reshape({-1}));
  EXPECT_TRUE(torch::allclose(model->forward_loss(idx, targets), expected));
}

TEST(Gpt, SizesThatCannotWorkAreRefusedByFlag) {
  const auto refused = [](GptConfig config, const std::string& flag) {
    try {
      config.validate();
      ADD_FAILURE() << "expected InvalidArgument for " << flag;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(flag), std::string::npos) << e.what();
    }
  };
  GptConfig config = tiny_gpt();
  config.n_head = 3;
  refused(config, "--n-embd must be a positive multiple of --n-head");
  config = tiny_gpt();
  config.n_layer = 0;
  refused(config, "--n-layer");
  config = tiny_gpt();
  config.dropout = 1;
  refused(config, "--dropout");
  // A sequence longer than the block size.
  ModelOptions options;
  options.gpt = tiny_gpt();
  auto model = create("gpt", 0, options);
  EXPECT_THROW(model->forward(torch::zeros({1, 9}, torch::kLong)), InvalidArgument);
}

}  // namespace test_models
}  // namespace shoal::models
