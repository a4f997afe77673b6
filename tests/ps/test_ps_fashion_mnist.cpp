// asp and ssp train on the real Fashion-MNIST to within one point of bsp's test accuracy after
// the same three epochs, all three with the cosine learning-rate schedule (--lr-schedule cosine,
// carried by every push). To fit the test budget: the MLP (the CNN costs ~10x the compute per
// sample here), 2 workers x batch 64 on the first 8000 training images, the full 10000-image test
// set; the built-in Trainer with PsStrategy in each worker thread, one server.
//
// Why the schedule: with a constant rate one end-of-epoch evaluation swings by 2-3 points under
// asp (measured gaps to bsp, mean of the last two epochs, lr 0.05: asp -2.8 .. +0.3, ssp -1.8 ..
// -0.5 points); annealing the rate to 0 anneals the stale updates' noise with it (measured with
// the schedule, final epoch: asp -0.3 .. +0.1, ssp -0.4 .. 0.0 points over five runs, on a loaded
// machine). On the CNN the gap is too close to one point to assert without flakes (measured
// 2026-12-03, 2 workers x 64, 8000 images, lr 0.1, momentum 0.5, cosine: after six epochs asp
// +0.23 .. -1.05 points over six runs, one of them a failure on LibTorch 2.x; see issue 13).
#include <gtest/gtest.h>

#include "ps_testing.h"
#include "shoal/data/fashion_mnist.h"
#include "shoal/models/registry.h"
#include "shoal/train/ps_strategy.h"
#include "shoal/train/trainer.h"
#include "testing/idx_files.h"
#include "testing/multi_rank.h"

namespace shoal::ps {
namespace {

constexpr int kWorkers = 2;
constexpr int64_t kTrainSamples = 8000;
// Why momentum 0.5: asynchrony itself acts as momentum (Mitliagkas et al., 2016: about 1 - 1/W),
// so 0.9 on top overshoots under asp/ssp while bsp does not; 0.5 leaves room for it.
// Why 0.05: at 0.1 one epoch's accuracy swung by 2-3 points under asp (a CI run on LibTorch 2.15:
// asp 3.2 points below bsp); at 0.05 the gaps measured were 0.4-1.8 points.
constexpr double kLr = 0.05;
constexpr double kMomentum = 0.5;

double train_accuracy(Consistency consistency, const train::TensorData& train_data,
                      const train::TensorData& test_data) {
  ServerOptions options;
  options.num_workers = kWorkers;
  options.consistency = consistency;
  options.staleness = 2;
  options.optimizer = std::make_shared<Sgd>(SgdOptions{kLr, kMomentum});
  options.auth_token_from_env = false;
  options.verbose = false;
  testing::ServerSet set(1, options);
  std::vector<double> accuracy(kWorkers, 0);
  shoal::testing::run_threads(kWorkers, [&](int rank) {
    train::TrainOptions to;
    to.model = "mlp";
    to.epochs = 3;
    to.batch_size = 64;
    to.lr = kLr;
    to.momentum = kMomentum;
    to.lr_schedule = "cosine";
    to.threads = 0;
    to.progress = train::ProgressMode::kNone;
    to.log_interval = 0;
    auto strategy = std::make_unique<train::PsStrategy>(testing::worker_options(set, rank, kWorkers));
    train::Trainer trainer(to, models::create(to.model, to.seed), std::move(strategy));
    accuracy[rank] = trainer.fit(train_data, test_data).final_test_accuracy();
  }, std::chrono::milliseconds(120000));
  set.join();
  EXPECT_EQ(accuracy[0], accuracy[1]) << "metrics are summed over the workers";
  return accuracy[0];
}

TEST(PsFashionMnist, AspAndSspWithinOnePointOfBspWithTheCosineSchedule) {
  if (!shoal::testing::have_real_fashion_mnist()) {
    shoal::testing::skip_program("Fashion-MNIST is not installed (apt-get install dataset-fashion-mnist)");
  }
  torch::set_num_threads(1);
  const data::FashionMnist train_set(data::FashionMnist::kDefaultRoot, true);
  const data::FashionMnist test_set(data::FashionMnist::kDefaultRoot, false);
  const train::TensorData train_data{train_set.images().slice(0, 0, kTrainSamples),
                                     train_set.targets().slice(0, 0, kTrainSamples)};
  const train::TensorData test_data{test_set.images(), test_set.targets()};
  const double bsp = train_accuracy(Consistency::kBsp, train_data, test_data);
  const double asp = train_accuracy(Consistency::kAsp, train_data, test_data);
  const double ssp = train_accuracy(Consistency::kSsp, train_data, test_data);
  std::printf("test accuracy: bsp %.4f, asp %.4f, ssp(2) %.4f\n", bsp, asp, ssp);
  EXPECT_GT(bsp, 0.79) << "bsp learned";
  EXPECT_LE(std::abs(asp - bsp), 0.01) << "asp ended more than one point from bsp";
  EXPECT_LE(std::abs(ssp - bsp), 0.01) << "ssp ended more than one point from bsp";
}

}  // namespace
}  // namespace shoal::ps
