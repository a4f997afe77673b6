// Data-parallel training of your own LibTorch model with Shoal's DistributedDataParallel and
// DistributedSampler: the C++ version of PyTorch's DDP tutorial loop. Copy it and change the model
// and the data.
//
//   ./example_ddp_fashion_mnist                              # one process
//   shoal run --nproc-per-node 2 ./example_ddp_fashion_mnist # two ranks (the launcher sets RANK...)
//   ./example_ddp_fashion_mnist EPOCHS [CHECKPOINT.pt]       # default 3 epochs, no checkpoint
//
// The data here is synthetic (Fashion-MNIST-shaped: 1x28x28 images, 10 classes) so that the
// example runs anywhere; shoal::data::FashionMnist loads the real images (see
// train_fashion_mnist.cpp). This file is also the project that CI builds against the installed
// Shoal (examples/CMakeLists.txt): find_package(Shoal) and one include.
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include <shoal/shoal.h>

// Your model: nothing Shoal-specific in it.
struct NetImpl : torch::nn::Module {
  NetImpl()
      : conv(register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 8, 3)))),
        fc1(register_module("fc1", torch::nn::Linear(8 * 13 * 13, 64))),
        fc2(register_module("fc2", torch::nn::Linear(64, 10))) {}
  torch::Tensor forward(torch::Tensor x) {
    x = torch::max_pool2d(torch::relu(conv(x)), 2).flatten(1);
    return torch::log_softmax(fc2(torch::relu(fc1(x))), 1);
  }
  torch::nn::Conv2d conv;
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Net);

int main(int argc, char** argv) {
  const uint64_t epochs = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 3;
  const std::string checkpoint_path = argc > 2 ? argv[2] : "";
  torch::set_num_threads(1);  // one thread per rank; run as many ranks as cores
  // Rank, world size and rendezvous come from the launcher's environment (RANK, WORLD_SIZE,
  // MASTER_ADDR, ...); a lone process is rank 0 of 1.
  auto pg = shoal::init_process_group();

  // A synthetic dataset: labels are a function of the image, so the model can learn it.
  constexpr int64_t kDatasetSize = 2048;
  torch::manual_seed(1234);  // the same data on every rank
  auto images = torch::randn({kDatasetSize, 1, 28, 28});
  auto labels = images.mean({1, 2, 3}).mul(40).floor().clamp(-5, 4).add(5).to(torch::kLong);

  Net net;
  // Construction checks every rank built the same model and copies rank 0's weights everywhere.
  shoal::DistributedDataParallel ddp(net, pg);
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));

  // Each rank sees its own shard of every epoch, reshuffled per epoch (seed + epoch).
  shoal::DistributedSampler sampler(kDatasetSize, pg->rank(), pg->size(), /*shuffle=*/true);
  constexpr size_t kBatch = 32;
  for (uint64_t epoch = 0; epoch < epochs; ++epoch) {
    sampler.set_epoch(epoch);
    double loss_sum = 0;
    int64_t steps = 0;
    while (auto batch = sampler.next(kBatch)) {
      auto index = torch::tensor(std::vector<int64_t>(batch->begin(), batch->end()), torch::kLong);
      auto x = images.index_select(0, index);
      auto y = labels.index_select(0, index);
      optimizer.zero_grad();
      auto loss = torch::nll_loss(ddp.forward(x), y);
      loss.backward();  // gradients are averaged across ranks while backward runs
      optimizer.step();
      loss_sum += loss.item<double>();
      ++steps;
    }
    // The average loss over every rank, for the log.
    auto mean_loss = torch::tensor({loss_sum / std::max<int64_t>(steps, 1)});
    pg->allreduce(mean_loss, {shoal::ReduceOp::kAvg})->wait();
    if (pg->rank() == 0) {
      std::printf("epoch %llu: loss %.4f (%d ranks x %lld steps)\n",
                  static_cast<unsigned long long>(epoch), mean_loss.item<double>(), pg->size(),
                  static_cast<long long>(steps));
    }
    // A checkpoint: rank 0 saves net's state (its names carry no "module." prefix) in
    // torch.save's format; Python reads it with torch.load.
    if (!checkpoint_path.empty() && pg->rank() == 0) {
      shoal::save_state_dict(shoal::state_dict(*net), checkpoint_path);
    }
  }
  return 0;
}
