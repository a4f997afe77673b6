// The pipeline strategy in the built-in trainer: the same epoch results and weights as one
// process, and checkpoints that are one ordinary state dict: saved from a pipeline, resumed under
// DDP and the other way round, ending where one process training throughout ends.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ATen/CPUGeneratorImpl.h>

#include <filesystem>
#include <map>

#include "shoal/checkpoint/checkpoint_manager.h"
#include "shoal/checkpoint/serialization.h"
#include "shoal/checkpoint/state_dict.h"
#include "shoal/comm/init.h"
#include "shoal/models/registry.h"
#include "shoal/train/ddp_strategy.h"
#include "shoal/train/pipeline_strategy.h"
#include "shoal/train/trainer.h"
#include "testing/multi_rank.h"

namespace shoal::train {
namespace test_pipeline_checkpoint {

using Milliseconds = std::chrono::milliseconds;
constexpr Milliseconds kTimeout{60'000};
constexpr uint64_t kSeed = 3;
constexpr int64_t kGlobalBatch = 16;

TensorData synthetic(int64_t n, uint64_t seed) {
  auto generator = at::make_generator<at::CPUGeneratorImpl>(seed);
  return {torch::randn({n, 1, 28, 28}, generator),
          torch::randint(0, 10, {n}, generator, torch::kLong)};
}

TrainOptions base_options(int64_t epochs, int64_t batch, const std::string& dir) {
  TrainOptions options;
  options.model = "mlp";
  options.epochs = epochs;
  options.batch_size = batch;
  options.lr = 0.05;
  options.momentum = 0.9;
  options.seed = kSeed;
  options.progress = ProgressMode::kNone;
  options.log_interval = 0;
  options.checkpoint_dir = dir;
  return options;
}

using Weights = std::map<std::string, at::Tensor>;

Weights weights_of(const torch::nn::Module& model) {
  Weights out;
  for (const auto& p : model.named_parameters()) out[p.key()] = p.value().detach().clone();
  return out;
}

double max_relative_difference(const Weights& a, const Weights& b) {
  double worst = 0;
  EXPECT_EQ(a.size(), b.size());
  for (const auto& [name, value] : b) {
    const double scale = std::max(value.abs().max().item<double>(), 1e-12);
    worst = std::max(worst, (a.at(name) - value).abs().max().item<double>() / scale);
  }
  return worst;
}

struct Outcome {
  Weights weights;           // rank 0's whole model after fit
  TrainResult result;        // rank 0's
};

enum class Kind { kPipeline, kHybrid, kDdp };

// Trains `world` threads-as-ranks of `kind` (resuming from `dir` when `resume`).
Outcome train(Kind kind, int world, const TensorData& data, const TensorData& test, int64_t epochs,
          const std::string& dir, bool resume) {
  torch::set_num_threads(1);
  std::vector<std::shared_ptr<models::Model>> models;
  for (int r = 0; r < world; ++r) models.push_back(models::create("mlp", kSeed));
  const int64_t batch = kind == Kind::kPipeline ? kGlobalBatch : kGlobalBatch / 2;
  Outcome run;
  auto store = comm::make_hash_store(kTimeout);
  shoal::testing::run_threads(world, [&](int rank) {
    auto group = comm::new_process_group("shm", store, rank, world, kTimeout);
    std::unique_ptr<Strategy> strategy;
    if (kind == Kind::kDdp) {
      strategy = std::make_unique<DdpStrategy>(group);
    } else {
      PipelineStrategyOptions pipe;
      pipe.stages = 2;
      pipe.pipeline.micro_batches = 4;
      strategy = std::make_unique<PipelineStrategy>(pipe, group);
    }
    TrainOptions options = base_options(epochs, batch, dir);
    Trainer trainer(options, models[rank], std::move(strategy));
    if (resume) trainer.resume();
    TrainResult result = trainer.fit(data, test);
    if (rank == 0) {
      run.result = result;
      run.weights = weights_of(*models[0]);
    }
  });
  return run;
}

Outcome train_single(const TensorData& data, const TensorData& test, int64_t epochs) {
  torch::set_num_threads(1);
  auto model = models::create("mlp", kSeed);
  Trainer trainer(base_options(epochs, kGlobalBatch, ""), model);
  Outcome run;
  run.result = trainer.fit(data, test);
  run.weights = weights_of(*model);
  return run;
}

class PipelineTrainer : public ::testing::Test {
 protected:
  void SetUp() override {
    data_ = synthetic(64, 1);
    test_ = synthetic(40, 2);
    reference_ = train_single(data_, test_, 2);
  }
  std::string fresh_dir(const std::string& stem) {
    const std::string dir = shoal::testing::temp_path(stem);
    std::filesystem::create_directories(dir);
    dirs_.push_back(dir);
    return dir;
  }
  void TearDown() override {
    for (const auto& dir : dirs_) std::filesystem::remove_all(dir);
  }
  TensorData data_, test_;
  Outcome reference_;
  std::vector<std::string> dirs_;
};

TEST_F(PipelineTrainer, PipelineAndHybridMatchOneProcess) {
  for (Kind kind : {Kind::kPipeline, Kind::kHybrid}) {
    SCOPED_TRACE(kind == Kind::kPipeline ? "2 stages" : "2 stages x 2 replicas");
    const Outcome run = train(kind, kind == Kind::kPipeline ? 2 : 4, data_, test_, 2, "", false);
    EXPECT_LE(max_relative_difference(run.weights, reference_.weights), 1e-5);
    ASSERT_EQ(run.result.epochs.size(), 2u);
    for (size_t e = 0; e < 2; ++e) {
      const EpochResult& got = run.result.epochs[e];
      const EpochResult& want = reference_.result.epochs[e];
      EXPECT_NEAR(got.train_loss, want.train_loss, 1e-5 * want.train_loss) << "epoch " << e;
      EXPECT_NEAR(got.test_loss, want.test_loss, 1e-5 * want.test_loss) << "epoch " << e;
      EXPECT_DOUBLE_EQ(got.test_accuracy, want.test_accuracy) << "epoch " << e;
    }
  }
}

TEST_F(PipelineTrainer, CheckpointFromPipelineResumesUnderDdpAndBack) {
  // Pipeline for epoch 1, DDP for epoch 2.
  const std::string a = fresh_dir("pipe_to_ddp");
  train(Kind::kPipeline, 2, data_, test_, 1, a, false);
  const auto latest = checkpoint::find_latest(a);
  ASSERT_TRUE(latest.has_value());
  // One ordinary state dict: the whole model's keys, every stage's trained weights.
  const checkpoint::TrainingState saved = checkpoint::load_training_state(*latest);
  auto fresh = models::create("mlp", kSeed);
  EXPECT_EQ(saved.model.keys(), checkpoint::state_dict(*fresh).keys());
  EXPECT_EQ(saved.optimizer.state.size(), fresh->parameters().size())
      << "every parameter's momentum buffer, from whichever stage trains it";
  const Outcome pipe_then_ddp = train(Kind::kDdp, 2, data_, test_, 2, a, true);
  EXPECT_LE(max_relative_difference(pipe_then_ddp.weights, reference_.weights), 1e-5);

  // DDP for epoch 1, the pipeline for epoch 2.
  const std::string b = fresh_dir("ddp_to_pipe");
  train(Kind::kDdp, 2, data_, test_, 1, b, false);
  const Outcome ddp_then_pipe = train(Kind::kPipeline, 2, data_, test_, 2, b, true);
  EXPECT_LE(max_relative_difference(ddp_then_pipe.weights, reference_.weights), 1e-5);
  EXPECT_NEAR(ddp_then_pipe.result.epochs.back().test_loss,
              reference_.result.epochs.back().test_loss,
              1e-5 * reference_.result.epochs.back().test_loss);
}

}  // namespace test_pipeline_checkpoint
}  // namespace shoal::train
