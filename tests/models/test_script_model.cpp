// ScriptModel: a TorchScript module built and saved here, loaded as a Model. Its parameters
// and buffers carry the script module's names and are the script module's own tensors (an
// optimizer step on the adapter changes the script module); train()/eval() reach the script code;
// clone_module() is independent; a file that is not TorchScript is one line.
#include <gtest/gtest.h>
#include <torch/script.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>

#include "shoal/error.h"
#include "shoal/models/registry.h"
#include "shoal/models/script_model.h"

namespace shoal::models {
namespace test_script_model {

namespace fs = std::filesystem;

/// root.bias [3] + lin (weight [3,4], buffer `calls` counting training-mode forwards).
torch::jit::Module make_module() {
  torch::jit::Module lin("Lin");
  // What torch.jit.script gives every nn.Module, and what jit::Module::train() sets.
  lin.register_attribute("training", c10::BoolType::get(), true);
  lin.register_parameter("weight", (torch::arange(12, torch::kFloat).reshape({3, 4}) / 10).requires_grad_(), false);
  lin.register_buffer("calls", torch::zeros({1}));
  lin.define(R"(
def forward(self, x):
    if self.training:
        self.calls.add_(1.0)
    return x.matmul(self.weight.t())
)");
  torch::jit::Module root("Root");
  root.register_attribute("training", c10::BoolType::get(), true);
  root.register_module("lin", lin);
  root.register_parameter("bias", torch::ones({3}).requires_grad_(), false);
  root.define(R"(
def forward(self, x):
    return self.lin.forward(x) + self.bias
)");
  return root;
}

std::string saved_module() {
  const fs::path path = fs::temp_directory_path() / ("shoal_script_" + std::to_string(::getpid()) + ".pt");
  make_module().save(path.string());
  return path.string();
}

TEST(ScriptModel, ParametersAndBuffersAreTheScriptModulesOwnUnderItsNames) {
  const std::string path = saved_module();
  std::shared_ptr<Model> model = create(path);  // a path: loaded, not a built-in name
  fs::remove(path);
  auto* script = dynamic_cast<ScriptModel*>(model.get());
  ASSERT_NE(script, nullptr);
  std::vector<std::string> names;
  for (const auto& item : model->named_parameters()) names.push_back(item.key());
  EXPECT_EQ(names, (std::vector<std::string>{"bias", "lin.weight"}));
  std::vector<std::string> buffers;
  for (const auto& item : model->named_buffers()) buffers.push_back(item.key());
  EXPECT_EQ(buffers, (std::vector<std::string>{"lin.calls"}));

  // The forward is the script's: x W^T + b.
  const at::Tensor x = torch::ones({2, 4});
  const at::Tensor expected =
      x.matmul((torch::arange(12, torch::kFloat).reshape({3, 4}) / 10).t()) + 1;
  EXPECT_TRUE(torch::allclose(model->forward(x), expected));

  // One SGD step through the adapter's parameters changes the script module's tensors.
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.5));
  sgd.zero_grad();
  model->forward(x).sum().backward();
  sgd.step();
  const at::Tensor bias = script->script_module().attr("bias").toTensor();
  EXPECT_TRUE(torch::allclose(bias, torch::full({3}, 1.0 - 0.5 * 2)));  // d(sum)/d(bias) = 2
  EXPECT_EQ(bias.data_ptr(), model->named_parameters()["bias"].data_ptr());
}

TEST(ScriptModel, TrainAndEvalReachTheScriptCode) {
  ScriptModel model(make_module());
  const at::Tensor calls = model.named_buffers()["lin.calls"];
  model.train();
  model.forward(torch::ones({1, 4}));
  EXPECT_EQ(calls.item<float>(), 1.0f);
  model.eval();
  EXPECT_FALSE(model.is_training());
  EXPECT_FALSE(model.script_module().is_training());
  model.forward(torch::ones({1, 4}));
  EXPECT_EQ(calls.item<float>(), 1.0f);  // eval: the buffer is left alone
  model.train();
  model.forward(torch::ones({1, 4}));
  EXPECT_EQ(calls.item<float>(), 2.0f);
}

TEST(ScriptModel, CloneModuleHasTensorsOfItsOwn) {
  ScriptModel model(make_module());
  std::shared_ptr<ScriptModel> copy = model.clone_module();
  torch::NoGradGuard no_grad;
  copy->named_parameters()["bias"].fill_(7);
  EXPECT_TRUE(torch::equal(model.named_parameters()["bias"], torch::ones({3})));
  EXPECT_TRUE(torch::equal(copy->forward(torch::zeros({1, 3 + 1})), torch::full({1, 3}, 7.0)));
}

TEST(ScriptModel, AFileThatIsNotTorchScriptIsOneLine) {
  const fs::path path = fs::temp_directory_path() / ("shoal_not_script_" + std::to_string(::getpid()) + ".pt");
  std::ofstream(path) << "not a zip archive";
  try {
    ScriptModel::load(path.string());
    ADD_FAILURE() << "loaded";
  } catch (const InvalidArgument& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find(path.string() + ": not a TorchScript model"), std::string::npos) << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  }
  fs::remove(path);
  EXPECT_THROW(ScriptModel::load("/nonexistent/model.pt"), InvalidArgument);
  EXPECT_TRUE(is_script_path("a/b"));
  EXPECT_TRUE(is_script_path("m.pt"));
  EXPECT_FALSE(is_script_path("cnn"));
}

}  // namespace test_script_model
}  // namespace shoal::models
