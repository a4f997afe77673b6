// The training pieces used outside the CLI: train_step() is one exact SGD step, run_training()
// trains from a data folder (as `shoal train` does, without the CLI), and Progress draws a live
// bar (kBar), plain lines (kLines) or nothing but summaries (kNone) into the stream given.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "shoal/error.h"
#include "shoal/launcher/launch.h"
#include "shoal/models/registry.h"
#include "shoal/train/progress.h"
#include "shoal/train/strategy_spec.h"
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

/// The message of the InvalidArgument `check` throws; empty when it throws none.
template <typename F>
std::string refusal(F check) {
  try {
    check();
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "";
}

// The Trainer refuses a GPU for a strategy built without a StrategySpec by the spec's own rule:
// a strategy trains on the CPU unless it says otherwise (single and plain DDP do).
TEST(StrategySpec, TheTrainerAndTheSpecShareTheDeviceRule) {
  struct CpuOnly : Strategy {
    std::string name() const override { return "cpu-only"; }
  };
  EXPECT_TRUE(SingleProcess().trains_on_gpu());
  EXPECT_FALSE(CpuOnly().trains_on_gpu());
  const std::string message = refusal([] {
    check_strategy_device("cuda:1", CpuOnly().trains_on_gpu(), CpuOnly().name());
  });
  EXPECT_NE(message.find("--device cuda:1: --strategy cpu-only trains on the CPU here; on a GPU, use "
                         "--strategy single or plain ddp"),
            std::string::npos)
      << message;
  EXPECT_EQ(refusal([] { check_strategy_device("cpu", false, "ps"); }), "");
  EXPECT_EQ(refusal([] { check_strategy_device("cuda", true, "ddp"); }), "");
}

// The strategy rules a C++ user meets without the CLI (which runs the same validate()).
TEST(StrategySpec, RefusesWhatTheStrategyCannotDo) {
  TrainOptions options;
  StrategySpec spec;
  spec.kind = StrategyKind::kPs;
  EXPECT_EQ(refusal([&] { spec.validate(options); }), "");
  options.clip_grad_norm = 1;
  EXPECT_NE(refusal([&] { spec.validate(options); }).find("--clip-grad-norm is not supported with --strategy ps"),
            std::string::npos);
  options.clip_grad_norm = 0;
  options.weight_decay = 0.1;  // the servers' SGD has none; their Adam and AdamW have
  EXPECT_NE(refusal([&] { spec.validate(options); }).find("--weight-decay with --optimizer sgd is not supported with --strategy ps"),
            std::string::npos);
  options.optimizer = Optimizer::kAdamW;
  EXPECT_EQ(refusal([&] { spec.validate(options); }), "");
  options.optimizer = Optimizer::kSgd;
  options.weight_decay.reset();
  options.device = "cuda";
  EXPECT_NE(refusal([&] { spec.validate(options); }).find("--device cuda: --strategy ps trains on the CPU"),
            std::string::npos);
  spec.kind = StrategyKind::kDdp;
  EXPECT_EQ(refusal([&] { spec.validate(options); }), "");
  spec.model_parallel = 2;
  EXPECT_FALSE(spec.supports(StrategyFeature::kGpu));
  EXPECT_NE(refusal([&] { spec.validate(options); }).find("with --model-parallel trains on the CPU"),
            std::string::npos);
  options.device = "cpu";
  spec.comm_hook = CommHookKind::kFp16;
  EXPECT_NE(refusal([&] { spec.validate(options); }).find("--comm-hook fp16 applies to --strategy ddp"),
            std::string::npos);
  spec.comm_hook = CommHookKind::kAllreduce;
  spec.bucket_cap_mb = 5;
  EXPECT_NE(refusal([&] { spec.validate(options); }).find("--bucket-cap-mb applies"), std::string::npos);
  spec.model_parallel = 1;
  EXPECT_EQ(refusal([&] { spec.validate(options); }), "");
  options.checkpoint_format = ::shoal::train::CheckpointFormat::kSharded;
  EXPECT_NE(refusal([&] { spec.validate(options); }).find("--checkpoint-format sharded applies to --strategy fsdp"),
            std::string::npos);
  spec.kind = StrategyKind::kFsdp;
  spec.bucket_cap_mb.reset();
  EXPECT_EQ(refusal([&] { spec.validate(options); }), "");
  spec.model_parallel = 2;
  EXPECT_NE(refusal([&] { spec.validate(options); }).find("--model-parallel applies to --strategy ddp, not fsdp"),
            std::string::npos);
  // The processes a job runs on this host.
  spec.kind = StrategyKind::kPipeline;
  spec.stages = 3;
  EXPECT_EQ(spec.local_processes(), 3);
  spec.kind = StrategyKind::kDp;
  EXPECT_EQ(spec.replica_count(), 2);
  EXPECT_EQ(spec.local_processes(), 1);
  EXPECT_FALSE(spec.runs_as_job());
}

TEST(StrategySpec, ChoicesParseToTheirEnumsAndBack) {
  for (const std::string& name : strategy_names()) EXPECT_EQ(strategy_name(parse_strategy(name)), name);
  for (const std::string& name : comm_hook_names()) EXPECT_EQ(comm_hook_name(parse_comm_hook(name)), name);
  for (const std::string& name : optimizer_names()) EXPECT_EQ(optimizer_name(parse_optimizer(name)), name);
  EXPECT_EQ(optimizer_names(), (std::vector<std::string>{"sgd", "adam", "adamw"}));
  EXPECT_EQ(refusal([] { parse_optimizer("lamb"); }).find("optimizer must be sgd, adam or adamw, got 'lamb'"),
            0u);
  // TrainOptions' closed choices: the names a checkpoint's config and the CLI use.
  for (const std::string& name : lr_schedule_names()) EXPECT_EQ(lr_schedule_name(parse_lr_schedule(name)), name);
  for (const std::string& name : precision_names()) EXPECT_EQ(precision_name(parse_precision(name)), name);
  for (const std::string& name : checkpoint_format_names()) {
    EXPECT_EQ(checkpoint_format_name(parse_checkpoint_format(name)), name);
  }
  EXPECT_EQ(lr_schedule_names(), (std::vector<std::string>{"constant", "cosine", "step", "multistep"}));
  EXPECT_EQ(precision_names(), (std::vector<std::string>{"fp32", "bf16", "fp16"}));
  EXPECT_EQ(checkpoint_format_names(), (std::vector<std::string>{"full", "sharded"}));
  EXPECT_EQ(refusal([] { parse_precision("fp8"); }).find("precision must be fp32, bf16 or fp16, got 'fp8'"),
            0u);
  EXPECT_EQ(refusal([] { parse_checkpoint_format("dcp"); })
                .find("--checkpoint-format must be full or sharded, got 'dcp'"),
            0u);
  EXPECT_NE(refusal([] { parse_comm_hook("int8"); }).find("unknown communication hook 'int8'"),
            std::string::npos);
  EXPECT_NE(refusal([] { parse_strategy("zero"); }), "");
}

// TORCHELASTIC_RESTART_COUNT, read in one place: a count, or a clear error (not atoi's 0).
TEST(StrategySpec, RestartCountIsACountOrAnError) {
  ::unsetenv("TORCHELASTIC_RESTART_COUNT");
  EXPECT_EQ(launcher::restart_count(), 0);
  ::setenv("TORCHELASTIC_RESTART_COUNT", "2", 1);
  EXPECT_EQ(launcher::restart_count(), 2);
  ::setenv("TORCHELASTIC_RESTART_COUNT", "two", 1);
  EXPECT_NE(refusal([] { launcher::restart_count(); }).find("TORCHELASTIC_RESTART_COUNT='two'"),
            std::string::npos);
  ::unsetenv("TORCHELASTIC_RESTART_COUNT");
}

}  // namespace test_train_api
}  // namespace shoal::train
