// The README's example: train the built-in CNN on Fashion-MNIST in one process, first with the
// built-in Trainer, then with a hand-written loop over the same pieces.
//
//   ./build/examples/example_train_fashion_mnist [data_dir]
#include <torch/torch.h>

#include <cstdio>

#include "shoal/data/fashion_mnist.h"
#include "shoal/models/registry.h"
#include "shoal/train/trainer.h"

int main(int argc, char** argv) {
  const std::string root = argc > 1 ? argv[1] : shoal::data::FashionMnist::kDefaultRoot;
  torch::set_num_threads(2);
  shoal::data::FashionMnist train(root, /*train=*/true);
  shoal::data::FashionMnist test(root, /*train=*/false);

  // 1. The built-in trainer: SGD with momentum, per-epoch evaluation, progress, metrics.
  shoal::train::TrainOptions options;  // the defaults of `shoal train`
  options.metrics_path = "metrics.jsonl";
  auto model = shoal::models::create("cnn", /*seed=*/0);
  shoal::train::Trainer trainer(options, model);
  const auto result =
      trainer.fit({train.images(), train.targets()}, {test.images(), test.targets()});
  std::printf("trainer: test accuracy %.4f\n", result.final_test_accuracy());

  // 2. The same epoch by hand: a PyTorch user's loop, with Shoal's data and shuffle.
  auto net = shoal::models::create("cnn", /*seed=*/0);
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  const int64_t batch = 64;
  const torch::Tensor order = shoal::train::shuffled_indices(train.size().value(), /*seed=*/0,
                                                             /*epoch=*/0);
  net->train();
  for (int64_t begin = 0; begin < order.size(0); begin += batch) {
    const torch::Tensor idx = order.slice(0, begin, begin + batch);
    sgd.zero_grad();
    const torch::Tensor loss = torch::nn::functional::cross_entropy(
        net->forward(train.images().index_select(0, idx)), train.targets().index_select(0, idx));
    loss.backward();
    sgd.step();
  }
  const auto eval = shoal::train::evaluate(
      *net, [&](const torch::Tensor& x) { return net->forward(x); },
      {test.images(), test.targets()}, /*batch_size=*/500);
  std::printf("hand-written loop: test accuracy %.4f\n", eval.accuracy);
  return 0;
}
