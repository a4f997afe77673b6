// Oracle: Shoal's single-process trainer and the same loop in Python PyTorch (Debian's
// python3-torch), from the same seed, data and order, end with the same parameters and losses.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "shoal/data/synthetic_dataset.h"
#include "shoal/models/registry.h"
#include "shoal/train/trainer.h"
#include "testing/multi_rank.h"
#include "testing/python.h"

namespace shoal::train {
namespace test_trainer_pytorch {

void check_against_pytorch(const std::string& model_name, int64_t size, int64_t epochs,
                           double lr, const std::string& schedule = "constant") {
  const char* source = std::getenv("SHOAL_SOURCE_DIR");
  if (source == nullptr) shoal::testing::skip_program(shoal::testing::Dependency::kOptional, "SHOAL_SOURCE_DIR is not set (run through ctest)");
  const uint64_t seed = 3, data_seed = 11;
  const int64_t batch = 32;
  const double momentum = 0.9;

  torch::set_num_threads(1);
  data::SyntheticOptions data_options;
  data_options.size = size;
  data_options.seed = data_seed;
  const data::SyntheticDataset data(data_options);
  TrainOptions options;
  options.model = model_name;
  options.seed = seed;
  options.epochs = epochs;
  options.batch_size = batch;
  options.lr = lr;
  options.momentum = momentum;
  options.lr_schedule = ::shoal::train::parse_lr_schedule(schedule);
  options.threads = 1;
  options.progress = ProgressMode::kNone;
  options.log_interval = 0;
  auto model = models::create(model_name, seed);
  Trainer trainer(options, model);
  const TrainResult result = trainer.fit({data.images(), data.targets()}, TensorData{});

  const std::string out = shoal::testing::temp_path("shoal-pytorch-train");
  std::ostringstream command;
  command << "/usr/bin/python3 " << source << "/tests/train/pytorch_train.py " << model_name << " "
          << seed << " " << data_seed << " " << size << " " << epochs << " " << batch << " " << lr
          << " " << momentum << " " << out << " " << schedule;
  const auto run = shoal::testing::run_command(command.str());
  // The script exits 77 when it cannot import torch (importing it is the slow part: once only).
  if (run.exit_code == shoal::testing::kNoTorchExitCode) {
    shoal::testing::skip_program(shoal::testing::Dependency::kPythonTorch, "python3-torch is not installed");
  }
  ASSERT_TRUE(shoal::testing::oracle_succeeded(run)) << command.str();
  std::vector<double> losses;  // one line per epoch, then the closing line
  std::istringstream lines(run.out);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind(shoal::testing::kOracleClosing, 0) != 0) losses.push_back(std::stod(line));
  }

  ASSERT_EQ(losses.size(), result.epochs.size());
  for (size_t i = 0; i < losses.size(); ++i) {
    EXPECT_NEAR(result.epochs[i].train_loss, losses[i], 1e-4 * std::abs(losses[i]))
        << "epoch " << i + 1;
  }
  std::ifstream in(out, std::ios::binary);
  for (const auto& item : model->named_parameters()) {
    const torch::Tensor& ours = item.value();
    std::vector<float> theirs(static_cast<size_t>(ours.numel()));
    in.read(reinterpret_cast<char*>(theirs.data()),
            static_cast<std::streamsize>(theirs.size() * sizeof(float)));
    ASSERT_TRUE(in) << "python wrote fewer parameters than " << item.key();
    const torch::Tensor expected = torch::from_blob(theirs.data(), ours.sizes(), torch::kFloat);
    // Same arithmetic in the same order up to BLAS blocking: float-rounding agreement.
    EXPECT_TRUE(torch::allclose(ours, expected, /*rtol=*/1e-4, /*atol=*/1e-5))
        << item.key() << ": max difference " << (ours - expected).abs().max().item<double>();
  }
  std::filesystem::remove(out);
}

TEST(TrainerVsPyTorch, MlpTwoEpochsMatch) { check_against_pytorch("mlp", 256, 2, 0.01); }
TEST(TrainerVsPyTorch, CnnOneEpochMatches) { check_against_pytorch("cnn", 64, 1, 0.01); }
// --lr-schedule cosine is PyTorch's CosineAnnealingLR over the run's steps (T_max = 2 x 8),
// stepped after each optimizer step; at lr 0.1 a wrong factor moves the weights visibly.
TEST(TrainerVsPyTorch, MlpCosineScheduleMatchesCosineAnnealingLr) {
  check_against_pytorch("mlp", 256, 2, 0.1, "cosine");
}

}  // namespace test_trainer_pytorch
}  // namespace shoal::train
