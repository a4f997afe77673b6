// bsp is DDP's math: W workers with batch b each, their mean gradient applied once per step by
// the servers' SGD with momentum, must equal single-process training with batch W*b (the same
// samples) after 50 steps, to 1e-5 relative, with one server and with two (tensors split).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <thread>

#include "shoal/checkpoint/serialization.h"
#include "shoal/error.h"
#include "shoal/train/train_options.h"

#include "ps_testing.h"
#include "testing/multi_rank.h"
#include "testing/python.h"

namespace shoal::ps {
namespace test_ps_bsp {

constexpr int kSteps = 50;
constexpr int kBatch = 4;
constexpr double kLr = 0.05;
constexpr double kMomentum = 0.9;

struct Data {
  at::Tensor inputs;   // [steps * W * b, 8]
  at::Tensor targets;  // [steps * W * b]
};

Data make_data(int workers) {
  torch::manual_seed(123);
  const int64_t n = int64_t{kSteps} * workers * kBatch;
  return {torch::randn({n, 8}), torch::randint(0, 4, {n}, torch::kLong)};
}

// The learning-rate factor of step t: 1, or the trainer's cosine schedule over the 50 steps.
double lr_factor(const std::string& schedule, int t) {
  return train::lr_schedule_factor(::shoal::train::parse_lr_schedule(schedule), t, kSteps);
}

// Single-process reference: step t uses rows [t*W*b, (t+1)*W*b), at lr kLr * factor.
testing::TinyNet reference(const Data& data, int workers, const std::string& schedule = "constant") {
  auto net = testing::make_tiny_net(7);
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(kLr).momentum(kMomentum));
  const int64_t global = int64_t{workers} * kBatch;
  for (int t = 0; t < kSteps; ++t) {
    sgd.param_groups().front().options().set_lr(kLr * lr_factor(schedule, t));
    sgd.zero_grad();
    const auto rows = torch::indexing::Slice(t * global, (t + 1) * global);
    torch::nn::functional::cross_entropy(net->forward(data.inputs.index({rows})),
                                         data.targets.index({rows}))
        .backward();
    sgd.step();
  }
  return net;
}

// Trains steps [first, last) with W worker threads against `set`; returns the workers' nets.
std::vector<testing::TinyNet> train_workers(testing::ServerSet& set, const Data& data, int workers,
                                            int first, int last,
                                            const std::string& schedule = "constant") {
  std::vector<testing::TinyNet> nets(workers, nullptr);
  shoal::testing::run_threads(workers, [&](int rank) {
    // Different initial weights on purpose: init() must give every worker rank 0's (or, after a
    // restore, the servers').
    auto net = testing::make_tiny_net(rank == 0 && first == 0 ? 7 : 1000 + rank);
    WorkerOptions wo = testing::worker_options(set, rank, workers);
    wo.split_threshold = 32;  // split fc1.weight (128) and fc2.weight (64) over the servers
    Worker worker(wo, testing::named(*net));
    worker.init();
    const int64_t global = int64_t{workers} * kBatch;
    for (int t = first; t < last; ++t) {
      net->zero_grad();
      const int64_t begin = t * global + int64_t{rank} * kBatch;
      const auto rows = torch::indexing::Slice(begin, begin + kBatch);
      torch::nn::functional::cross_entropy(net->forward(data.inputs.index({rows})),
                                           data.targets.index({rows}))
          .backward();
      worker.set_lr_factor(lr_factor(schedule, t));
      worker.step();
    }
    worker.close();
    nets[rank] = net;
  }, std::chrono::milliseconds(60000));
  set.join();
  return nets;
}

ServerOptions bsp_options(int workers) {
  ServerOptions options;
  options.num_workers = workers;
  options.consistency = Consistency::kBsp;
  options.optimizer = std::make_shared<Sgd>(SgdOptions{kLr, kMomentum});
  options.auth_token_from_env = false;
  options.verbose = false;
  return options;
}

void expect_equal_to_reference(const std::vector<testing::TinyNet>& nets,
                               testing::TinyNet& expected, const std::string& what) {
  const auto want = expected->named_parameters();
  for (size_t rank = 0; rank < nets.size(); ++rank) {
    for (const auto& item : nets[rank]->named_parameters()) {
      const at::Tensor& got = item.value();
      const at::Tensor& ref = want[item.key()];
      const double scale = ref.abs().max().item<double>();
      const double diff = (got - ref).abs().max().item<double>();
      EXPECT_LE(diff, 1e-5 * scale) << "worker " << rank << " " << item.key() << ", " << what;
    }
  }
}

void expect_bsp_equals_single_process(int num_servers, int workers) {
  torch::set_num_threads(1);
  const Data data = make_data(workers);
  testing::TinyNet expected = reference(data, workers);
  const ServerOptions options = bsp_options(workers);
  testing::ServerSet set(num_servers, options);  // every server from the same options
  const std::vector<testing::TinyNet> nets = train_workers(set, data, workers, 0, kSteps);
  expect_equal_to_reference(nets, expected, std::to_string(num_servers) + " servers");
  // Each server stepped its own copy of the optimizer: the caller's has no momentum buffers.
  for (uint32_t key = 0; key < 64; ++key) {
    EXPECT_TRUE(options.optimizer->state(key).empty()) << "key " << key;
  }
  for (const auto& server : set.servers) {
    const ServerStats stats = server->stats();
    EXPECT_EQ(stats.updates, kSteps) << "bsp applies the mean once per step";
    EXPECT_EQ(stats.pushes, int64_t{kSteps} * workers);
    EXPECT_EQ(stats.max_staleness, 0);
  }
  if (num_servers == 2) {
    // Both servers own a share: the split made the shards balanced.
    EXPECT_GT(set.servers[1]->shard_state().size(), 0u);
  }
}

TEST(PsBsp, TwoWorkersOneServerEqualsSingleProcess) { expect_bsp_equals_single_process(1, 2); }
TEST(PsBsp, ThreeWorkersTwoServersEqualsSingleProcess) { expect_bsp_equals_single_process(2, 3); }

// A schedule rides on the pushes: each step's factor scales the servers' lr, so bsp with the
// cosine schedule equals single-process SGD whose lr follows it (momentum buffer included).
TEST(PsBsp, CosineScheduleEqualsSingleProcessWithTheSameSchedule) {
  torch::set_num_threads(1);
  constexpr int kWorkers = 2;
  const Data data = make_data(kWorkers);
  testing::TinyNet expected = reference(data, kWorkers, "cosine");
  testing::TinyNet constant = reference(data, kWorkers);
  testing::ServerSet set(2, bsp_options(kWorkers));
  const std::vector<testing::TinyNet> nets = train_workers(set, data, kWorkers, 0, kSteps, "cosine");
  expect_equal_to_reference(nets, expected, "cosine schedule");
  // The schedule made a difference the comparison can see.
  EXPECT_GT((constant->fc1->weight - expected->fc1->weight).abs().max().item<double>(), 1e-3);
}


// Adam and AdamW on the servers: bsp equals single-process LibTorch Adam / AdamW (which
// test_train_features_pytorch checks against PyTorch's) on the same mean gradients, and the
// servers' shard state holds PyTorch's Adam state names.
TEST(PsBsp, AdamAndAdamWEqualSingleProcess) {
  torch::set_num_threads(1);
  constexpr int kWorkers = 2;
  const Data data = make_data(kWorkers);
  for (const bool decoupled : {false, true}) {
    AdamOptions adam;
    adam.lr = 0.01;
    adam.beta1 = 0.8;
    adam.beta2 = 0.99;
    adam.weight_decay = 0.05;
    adam.decoupled_weight_decay = decoupled;
    auto net = testing::make_tiny_net(7);
    std::unique_ptr<torch::optim::Optimizer> optimizer;
    if (decoupled) {
      optimizer = std::make_unique<torch::optim::AdamW>(
          net->parameters(), torch::optim::AdamWOptions(adam.lr)
                                 .betas(std::make_tuple(adam.beta1, adam.beta2))
                                 .weight_decay(adam.weight_decay));
    } else {
      optimizer = std::make_unique<torch::optim::Adam>(
          net->parameters(), torch::optim::AdamOptions(adam.lr)
                                 .betas(std::make_tuple(adam.beta1, adam.beta2))
                                 .weight_decay(adam.weight_decay));
    }
    const int64_t global = int64_t{kWorkers} * kBatch;
    for (int t = 0; t < kSteps; ++t) {
      optimizer->zero_grad();
      const auto rows = torch::indexing::Slice(t * global, (t + 1) * global);
      torch::nn::functional::cross_entropy(net->forward(data.inputs.index({rows})),
                                           data.targets.index({rows}))
          .backward();
      optimizer->step();
    }
    ServerOptions options = bsp_options(kWorkers);
    options.optimizer = std::make_shared<Adam>(adam);
    testing::ServerSet set(2, options);
    const std::vector<testing::TinyNet> nets = train_workers(set, data, kWorkers, 0, kSteps);
    expect_equal_to_reference(nets, net, decoupled ? "AdamW" : "Adam");
    const auto state = set.servers[0]->shard_state();
    bool has_adam_state = false;
    for (const auto& [name, tensor] : state) {
      if (name.size() > 5 && name.substr(name.size() - 5) == ".step") {
        has_adam_state = true;
        EXPECT_EQ(tensor.item<double>(), kSteps) << name;
        EXPECT_EQ(tensor.scalar_type(), at::kFloat) << name;
      }
    }
    EXPECT_TRUE(has_adam_state) << "the shard holds no Adam 'step'";
  }
}

// Servers save their shards (values and momentum buffers) after 20 steps; new servers restored
// from those files continue, and after 50 steps in all the result is the uninterrupted one.
TEST(PsBsp, ResumesFromServerCheckpoints) {
  torch::set_num_threads(1);
  constexpr int kWorkers = 2;
  constexpr int kServers = 2;
  const Data data = make_data(kWorkers);
  testing::TinyNet expected = reference(data, kWorkers);
  const std::string dir = shoal::testing::temp_path("ps-ckpt");
  std::filesystem::create_directories(dir);
  auto path = [&](int s) { return dir + "/server" + std::to_string(s) + ".pt"; };
  // Servers that save to (or restore from) path(s), each with its own optimizer state.
  auto start_servers = [&](testing::ServerSet& set, bool restore) {
    ServerOptions options = bsp_options(kWorkers);
    for (int s = 0; s < kServers; ++s) {
      options.rank = s;
      options.optimizer = std::make_shared<Sgd>(SgdOptions{kLr, kMomentum});
      (restore ? options.restore_path : options.checkpoint_path) = path(s);
      set.servers.push_back(std::make_unique<Server>(options));
      set.servers.back()->start();
    }
  };
  {
    testing::ServerSet set(0, bsp_options(kWorkers));
    start_servers(set, /*restore=*/false);
    train_workers(set, data, kWorkers, 0, 20);
  }
  // The file is an ordinary dict of tensors (what torch.load returns), with the momentum buffers.
  const checkpoint::StateDict saved = checkpoint::load_state_dict_file(path(0));
  bool has_momentum = false;
  for (const auto& item : saved) has_momentum |= item.key().find(".momentum_buffer") != std::string::npos;
  EXPECT_TRUE(has_momentum);
  // PyTorch itself reads it: a dict whose values match what Shoal read.
  const std::string check =
      "/usr/bin/python3 -c \"import sys, torch; d = torch.load(sys.argv[1]); "
      "assert isinstance(d, dict) and len(d) == " + std::to_string(saved.size()) +
      "; assert any(k.endswith('.momentum_buffer') for k in d); "
      "print('ORACLE OK torch.load read the shard')\" " + path(0);
  EXPECT_TRUE(shoal::testing::oracle_succeeded(shoal::testing::run_command(check))) << check;

  testing::ServerSet set(0, bsp_options(kWorkers));
  start_servers(set, /*restore=*/true);
  const std::vector<testing::TinyNet> nets = train_workers(set, data, kWorkers, 20, kSteps);
  expect_equal_to_reference(nets, expected, "resumed after 20 steps");
  std::filesystem::remove_all(dir);
}

// Checkpoint barriers of steps 10, 20 and 30 save "<prefix>.step<N>.pt", each holding its step;
// 2 are kept. A barrier of step 25 (a job resumed from 20 after one cut off past 30) deletes the
// file of step 30, which no worker checkpoint will pair with. A server restored from a file that
// holds another step than the workers' refuses it, naming both.
TEST(PsBsp, CheckpointBarriersSaveOneFilePerStep) {
  const std::string dir = shoal::testing::temp_path("ps-step-ckpt");
  std::filesystem::create_directories(dir);
  const std::string prefix = dir + "/ps-server0";
  ServerOptions options = bsp_options(1);
  options.step_checkpoint_prefix = prefix;
  options.step_checkpoint_keep = 2;
  auto files = [&] {
    std::vector<std::string> names;
    for (const auto& entry : std::filesystem::directory_iterator(dir)) {
      names.push_back(entry.path().filename().string());
    }
    std::sort(names.begin(), names.end());
    return names;
  };
  {
    testing::ServerSet set(1, options);
    auto net = testing::make_tiny_net(7);
    Worker worker(testing::worker_options(set, 0, 1), testing::named(*net));
    worker.init();
    for (int64_t step : {10, 20, 30}) worker.checkpoint_barrier(step);
    EXPECT_EQ(files(), (std::vector<std::string>{"ps-server0.step20.pt", "ps-server0.step30.pt"}));
    worker.checkpoint_barrier(25);
    EXPECT_EQ(files(), (std::vector<std::string>{"ps-server0.step20.pt", "ps-server0.step25.pt"}));
    worker.barrier();  // not a checkpoint: nothing saved
    EXPECT_EQ(files().size(), 2u);
    worker.close();
  }
  const auto saved = checkpoint::load_state_dict_file(step_checkpoint_path(prefix, 25));
  EXPECT_EQ(saved[kStepKey].item<int64_t>(), 25);

  ServerOptions restore = bsp_options(1);
  restore.restore_path = step_checkpoint_path(prefix, 25);
  restore.restore_step = 25;
  EXPECT_NO_THROW(Server{restore});
  restore.restore_step = 20;
  try {
    Server server(restore);
    ADD_FAILURE() << "a shard of step 25 restored for workers at step 20";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find(restore.restore_path + ": holds the shard of step 25, the "
                                         "workers resume from step 20"),
              std::string::npos)
        << e.what();
  }
  std::filesystem::remove_all(dir);
}

}  // namespace test_ps_bsp
}  // namespace shoal::ps
