// The training pieces used outside the CLI: train_step() is one exact SGD step, run_training()
// trains from a data folder (as `shoal train` does, without the CLI), and Progress draws a live
// bar (kBar), plain lines (kLines) or nothing but summaries (kNone) into the stream given.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>
#include <filesystem>
#include <string>

#include "shoal/error.h"
#include "shoal/models/registry.h"
#include "shoal/train/progress.h"
#include "shoal/train/trainer.h"
#include "testing/idx_files.h"

namespace shoal::train {
namespace test_train_api {

TEST(TrainStep, IsOneSgdStepOnTheBatch) {
  torch::set_num_threads(1);
  TrainState state;
  auto model = models::create("mlp", 4);
  state.model = model;
  auto twin = models::create("mlp", 4);
  state.optimizer = std::make_unique<torch::optim::SGD>(state.model->parameters(),
                                                        torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::optim::SGD twin_sgd(twin->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  state.model_forward = [model](const at::Tensor& x) { return model->forward(x); };
  state.forward = state.model_forward;
  torch::manual_seed(1);
  for (int i = 0; i < 3; ++i) {
    const auto x = torch::randn({8, 1, 28, 28});
    const auto y = torch::randint(0, 10, {8});
    const double loss = train_step(state, x, y);
    twin_sgd.zero_grad();
    const auto twin_loss = torch::nn::functional::cross_entropy(twin->forward(x), y);
    twin_loss.backward();
    twin_sgd.step();
    EXPECT_DOUBLE_EQ(loss, twin_loss.item<double>()) << "step " << i;
  }
  EXPECT_EQ(state.step, 3);
  const auto mine = state.model->parameters();
  const auto theirs = twin->parameters();
  ASSERT_EQ(mine.size(), theirs.size());
  for (size_t i = 0; i < mine.size(); ++i) EXPECT_TRUE(torch::equal(mine[i], theirs[i])) << i;
}

// run_training on a small generated dataset (the test split repeats the first training images,
// so a trainer that learns gets most of it right, one that does not about 1 in 10).
TEST(RunTraining, TrainsFromADataFolderWithoutTheCli) {
  const std::string dir = shoal::testing::make_small_dataset_dir(256, 64);
  TrainOptions options;
  options.model = "mlp";
  options.epochs = 3;
  options.batch_size = 32;
  options.lr = 0.05;
  options.threads = 1;
  options.progress = ProgressMode::kNone;
  options.log_interval = 0;
  options.data_dir = dir;
  const TrainResult result = run_training(options);
  ASSERT_EQ(result.epochs.size(), 3u);
  EXPECT_FALSE(result.stopped);
  EXPECT_LT(result.epochs[2].train_loss, result.epochs[0].train_loss);
  // Measured (deterministic for this seed): 0.23, 0.41, 0.47. Chance is 0.1: a trainer that
  // learns nothing fails both bounds.
  EXPECT_GT(result.final_test_accuracy(), 0.35);
  EXPECT_GT(result.final_test_accuracy(), result.epochs[0].test_accuracy + 0.1);
  // The same options give the same run.
  EXPECT_EQ(run_training(options).final_test_accuracy(), result.final_test_accuracy());
  options.data_dir = dir + "/missing";
  EXPECT_THROW(run_training(options), Error);
  std::filesystem::remove_all(dir);
}

// Everything Progress wrote to a temporary stream.
std::string run_progress(ProgressMode mode, std::string* summary) {
  std::FILE* out = std::tmpfile();
  std::FILE* summary_out = std::tmpfile();
  {
    Progress progress(mode, /*epochs=*/2, /*total_samples=*/2 * 40, /*log_interval=*/2, out,
                      summary_out);
    EXPECT_EQ(progress.mode(), mode);
    for (int64_t epoch = 0; epoch < 2; ++epoch) {
      progress.start_epoch(epoch, /*steps=*/4, /*samples=*/40);
      for (int64_t step = 1; step <= 4; ++step) progress.step(step, step * 10, 1.5 / step);
      EpochResult result;
      result.epoch = epoch + 1;
      result.train_loss = 0.5;
      result.test_accuracy = 0.75;
      progress.end_epoch(result);
    }
  }
  const auto read_all = [](std::FILE* f) {
    std::string text;
    std::rewind(f);
    char buffer[4096];
    while (size_t n = std::fread(buffer, 1, sizeof buffer, f)) text.append(buffer, n);
    std::fclose(f);
    return text;
  };
  *summary = read_all(summary_out);
  return read_all(out);
}

TEST(Progress, BarRedrawsOneLineInPlace) {
  std::string summary;
  const std::string bar = run_progress(ProgressMode::kBar, &summary);
  EXPECT_EQ(bar.find('\n'), std::string::npos) << "a bar never starts a new line: " << bar;
  EXPECT_NE(bar.find("\repoch 1/2 ["), std::string::npos) << bar;
  EXPECT_NE(bar.find("\repoch 2/2 ["), std::string::npos) << bar;
  // The last step of an epoch is always drawn: full bar, 100%.
  EXPECT_NE(bar.find("[========================] 100%"), std::string::npos) << bar;
  EXPECT_NE(bar.find("\033[K"), std::string::npos) << bar;
  // Cleared before each summary: the stream ends with the erase sequence.
  EXPECT_EQ(bar.substr(bar.size() - 4), "\r\033[K") << bar;
  EXPECT_NE(summary.find("epoch 1/2"), std::string::npos) << summary;
  EXPECT_NE(summary.find("epoch 2/2"), std::string::npos) << summary;
}

TEST(Progress, LinesAndNoneModes) {
  std::string summary;
  const std::string lines = run_progress(ProgressMode::kLines, &summary);
  EXPECT_EQ(lines.find('\r'), std::string::npos) << lines;
  EXPECT_NE(lines.find("step 2/4"), std::string::npos) << lines;
  EXPECT_NE(lines.find("step 4/4"), std::string::npos) << lines;
  EXPECT_EQ(lines.find("step 1/4"), std::string::npos) << "log_interval 2 prints every 2nd step";
  std::string none_summary;
  EXPECT_EQ(run_progress(ProgressMode::kNone, &none_summary), "");
  EXPECT_EQ(none_summary, summary) << "kNone keeps the per-epoch summaries";
  // kAuto on a file (not a terminal) is kLines.
  std::FILE* f = std::tmpfile();
  EXPECT_EQ(Progress(ProgressMode::kAuto, 1, 10, 1, f, nullptr).mode(), ProgressMode::kLines);
  std::fclose(f);
}

}  // namespace test_train_api
}  // namespace shoal::train
