// `shoal train` as a user meets it: bad input gives one clear stderr line and a non-zero exit; a
// small valid dataset trains end to end and prints the final accuracy and metrics.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <stdexcept>
#include <utility>
#include <vector>

#include "shoal/checkpoint/checkpoint_manager.h"
#include "shoal/checkpoint/serialization.h"
#include "shoal/checkpoint/training_state.h"
#include "shoal/error.h"
#include "shoal/train/train_option_table.h"
#include "shoal/train/trainer.h"
#include "testing/dependencies.h"
#include "testing/idx_files.h"
#include "testing/multi_rank.h"
#include "testing/shoal_cli.h"

namespace test_cli_train {

namespace fs = std::filesystem;

struct CliResult {
  int exit_code = -1;
  std::string out;
  std::string err;
};

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

std::string shoal_binary() {
  // Under ctest both hold; elsewhere this is a failure of the test's set-up, not a skip.
  const char* dir = std::getenv("SHOAL_BINARY_DIR");
  if (dir == nullptr) throw std::runtime_error("SHOAL_BINARY_DIR is not set (run through ctest)");
  const std::string path = std::string(dir) + "/apps/shoal/shoal";
  if (!fs::exists(path)) throw std::runtime_error(path + " is not built");
  return path;
}

// Runs `shoal ARGS` with stdout and stderr captured separately; `env` ("NAME=value ...") is added
// to the environment.
CliResult shoal_command(const std::string& args, const std::string& env = {}) {
  const std::string out = shoal::testing::temp_path("shoal-cli-out");
  const std::string err = shoal::testing::temp_path("shoal-cli-err");
  const std::string command =
      (env.empty() ? "" : "env " + env + " ") + shoal_binary() + " " + args + " >" + out + " 2>" + err;
  const int status = std::system(command.c_str());
  CliResult run;
  run.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  run.out = slurp(out);
  run.err = slurp(err);
  fs::remove(out);
  fs::remove(err);
  return run;
}

// Runs `shoal train ARGS` (see shoal_command).
CliResult shoal_train(const std::string& args, const std::string& env = {}) {
  return shoal_command("train " + args, env);
}

int count_lines(const std::string& text) {
  return static_cast<int>(std::count(text.begin(), text.end(), '\n'));
}

TEST(CliTrain, TruncatedTrainImagesGiveOneLineNamingTheFile) {
  SHOAL_SKIP_UNLESS(shoal::testing::have_real_fashion_mnist(), shoal::testing::Dependency::kDataset,
                    "Fashion-MNIST is not installed (apt-get install dataset-fashion-mnist)");
  const std::string dir = shoal::testing::make_temp_dir("shoal-cli-trunc");
  const std::string real = shoal::testing::real_fashion_mnist_dir();
  const std::string images = dir + "/train-images-idx3-ubyte.gz";
  shoal::testing::write_gzip(
      images, shoal::testing::read_gzip_prefix(real + "/train-images-idx3-ubyte.gz", 1000));
  for (const char* name : {"train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz",
                           "t10k-labels-idx1-ubyte.gz"}) {
    fs::copy_file(real + "/" + name, dir + "/" + name);
  }
  const CliResult run = shoal_train("--data-dir " + dir + " --no-progress");
  fs::remove_all(dir);
  EXPECT_NE(run.exit_code, 0);
  EXPECT_EQ(count_lines(run.err), 1) << run.err;
  EXPECT_NE(run.err.find(images), std::string::npos) << run.err;
  EXPECT_NE(run.err.find("truncated"), std::string::npos) << run.err;
  EXPECT_NE(run.err.find("47040016"), std::string::npos) << run.err;
}

TEST(CliTrain, MissingDataDirIsOneLine) {
  const CliResult run = shoal_train("--data-dir /nonexistent/fmnist --no-progress");
  EXPECT_NE(run.exit_code, 0);
  EXPECT_EQ(count_lines(run.err), 1) << run.err;
  EXPECT_NE(run.err.find("/nonexistent/fmnist"), std::string::npos) << run.err;
}

// The test split decodes on a thread of its own beside the training split; a damaged test
// split, a missing folder and an unknown model are reported as a serial read would (the model
// first, before any data error), in one process and under DDP.
TEST(CliTrain, DamagedTestSplitMissingFolderAndUnknownModelUnderDdpAreReportedInOrder) {
  SHOAL_SKIP_UNLESS(shoal::testing::have_real_fashion_mnist(), shoal::testing::Dependency::kDataset,
                    "Fashion-MNIST is not installed (apt-get install dataset-fashion-mnist)");
  const std::string dir = shoal::testing::make_temp_dir("shoal-cli-t10k");
  const std::string real = shoal::testing::real_fashion_mnist_dir();
  const std::string images = dir + "/t10k-images-idx3-ubyte.gz";
  shoal::testing::write_gzip(
      images, shoal::testing::read_gzip_prefix(real + "/t10k-images-idx3-ubyte.gz", 1000));
  for (const char* name : {"train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
                           "t10k-labels-idx1-ubyte.gz"}) {
    fs::copy_file(real + "/" + name, dir + "/" + name);
  }
  for (const std::string strategy : {"", " --strategy ddp --nproc-per-node 2"}) {
    const CliResult damaged =
        shoal_train("--model mlp --data-dir " + dir + " --no-progress" + strategy);
    EXPECT_NE(damaged.exit_code, 0) << strategy;
    EXPECT_NE(damaged.err.find(images + ": truncated"), std::string::npos) << strategy << damaged.err;
    const CliResult missing =
        shoal_train("--model mlp --data-dir /nonexistent/fmnist --no-progress" + strategy);
    EXPECT_NE(missing.exit_code, 0) << strategy;
    EXPECT_NE(missing.err.find("/nonexistent/fmnist: Fashion-MNIST directory not found"),
              std::string::npos)
        << strategy << missing.err;
    const CliResult model =
        shoal_train("--model resnet9000 --data-dir /nonexistent/fmnist --no-progress" + strategy);
    EXPECT_NE(model.exit_code, 0) << strategy;
    EXPECT_NE(model.err.find("resnet9000"), std::string::npos) << strategy << model.err;
    EXPECT_EQ(model.err.find("/nonexistent/fmnist"), std::string::npos) << strategy << model.err;
  }
  fs::remove_all(dir);
}

TEST(CliTrain, UnknownModelIsOneLineListingKnownOnes) {
  const CliResult run = shoal_train("--model resnet9000 --no-progress");
  EXPECT_NE(run.exit_code, 0);
  EXPECT_EQ(count_lines(run.err), 1) << run.err;
  EXPECT_NE(run.err.find("resnet9000"), std::string::npos) << run.err;
  EXPECT_NE(run.err.find("cnn"), std::string::npos) << run.err;
}

// A mistyped flag or subcommand, of any subcommand, gets the nearest one it has in its one line.
TEST(CliTrain, UnknownFlagSuggestsTheNearestOne) {
  const struct {
    const char* args;
    const char* suggestion;
  } cases[] = {
      {"train --epoch 2", "did you mean --epochs?"},
      {"train --batchsize=8", "did you mean --batch-size?"},
      {"bench ddp --bucket-cap 5", "did you mean --bucket-cap-mb?"},
      {"ckpt inspect --max-value 3 x.pt", "did you mean --max-values?"},
      {"plot --outptu x.png a.jsonl", "did you mean --output?"},
  };
  for (const auto& c : cases) {
    const CliResult run = shoal_command(c.args);
    EXPECT_EQ(run.exit_code, 2) << c.args << ": " << run.err;
    EXPECT_EQ(count_lines(run.err), 1) << c.args << ": " << run.err;
    EXPECT_NE(run.err.find(c.suggestion), std::string::npos) << c.args << ": " << run.err;
  }
  // Nothing near: no guess.
  const CliResult far = shoal_train("--zzzzzzzzzz 1");
  EXPECT_EQ(far.exit_code, 2) << far.err;
  EXPECT_EQ(far.err.find("did you mean"), std::string::npos) << far.err;
}

TEST(CliTrain, ZeroBatchSizeIsOneLine) {
  const CliResult run = shoal_train("--batch-size 0 --no-progress");
  EXPECT_NE(run.exit_code, 0);
  EXPECT_EQ(count_lines(run.err), 1) << run.err;
  EXPECT_NE(run.err.find("batch size"), std::string::npos) << run.err;
}

TEST(CliTrain, HelpDescribesTheOptions) {
  const CliResult run = shoal_train("--help");
  EXPECT_EQ(run.exit_code, 0);
  for (const char* option : {"--model", "--epochs", "--batch-size", "--lr", "--momentum", "--seed",
                             "--threads", "--data-dir", "--metrics", "--log-interval",
                             "--no-progress", "--train-samples", "--test-samples"}) {
    EXPECT_NE(run.out.find(option), std::string::npos) << option;
  }
}

/// The long flags `shoal train --help` lists ("--nproc-per-node,--nproc_per_node" gives both).
std::set<std::string> help_flags(const std::string& help) {
  std::set<std::string> flags;
  std::istringstream lines(help);
  for (std::string line; std::getline(lines, line);) {
    const size_t start = line.find_first_not_of(' ');
    // An option starts its line; its description's continuation lines are indented further.
    if (start == std::string::npos || start > 4 || line[start] != '-') continue;
    std::istringstream names(line.substr(start, line.find(' ', start) - start));
    for (std::string name; std::getline(names, name, ',');) {
      if (name.rfind("--", 0) == 0) flags.insert(name);
    }
  }
  return flags;
}

// The table of training options against what reads it: every row's flag is in --help (a
// hidden one is not), every flag in --help is a row's or one of the strategy's and the image
// folders' own, a checkpoint saves every row's key as the type old checkpoints hold, and a
// resume inherits each inheriting row's value back.
TEST(CliTrain, OptionTableMatchesHelpValidateAndCheckpointConfig) {
  const CliResult help = shoal_train("--help");
  ASSERT_EQ(help.exit_code, 0) << help.err;
  const std::set<std::string> flags = help_flags(help.out);
  std::set<std::string> rows;
  for (const shoal::train::TrainOption& row : shoal::train::train_option_table()) {
    rows.insert(row.flag);
    EXPECT_EQ(flags.count(row.flag), row.hidden ? 0u : 1u) << row.flag << " and --help differ";
  }
  // Flags of the strategy (StrategySpec), the image folders (ImageFolderOptions) and the aliases.
  const std::set<std::string> others = {
      "--help", "--strategy", "--nproc-per-node", "--nproc_per_node", "--max-restarts",
      "--max_restarts", "--replicas", "--shard", "--model-parallel", "--mesh", "--backend",
      "--consistency", "--staleness", "--servers", "--workers", "--comm-hook", "--bucket-cap-mb",
      "--powersgd-rank", "--powersgd-start-iter", "--worker-timeout", "--stages", "--sync",
      "--sync-every", "--outer-lr", "--outer-momentum", "--fault-tolerant", "--min-replicas",
      "--micro-batches", "--schedule", "--recompute", "--num_workers", "--prefetch_factor",
      "--image-size", "--random-crop", "--hflip", "--normalize"};
  for (const std::string& flag : flags) {
    EXPECT_TRUE(rows.count(flag) > 0 || others.count(flag) > 0)
        << flag << " is in --help but not in train_option_table()";
  }
  // validate() is the rows' checks: the defaults pass each; each choice the CLI offers passes,
  // a name beside them does not.
  const shoal::train::TrainOptions defaults;
  for (const shoal::train::TrainOption& row : shoal::train::train_option_table()) {
    if (row.check) EXPECT_NO_THROW(row.check(defaults)) << row.flag;
    if (row.choices.empty() || !row.set) continue;
    // A field of an enum type (the loss) has no check: its set() parses.
    const auto check = row.check ? row.check : [](const shoal::train::TrainOptions&) {};
    shoal::train::TrainOptions options;
    options.device = "cuda";  // fp16 needs it on LibTorch < 2.4
    for (const std::string& choice : row.choices) {
      row.set(options, c10::IValue(choice), "test");
      EXPECT_NO_THROW(check(options)) << row.flag << " " << choice;
    }
    bool refused = false;
    try {
      row.set(options, c10::IValue(std::string("none-of-these")), "test");
      check(options);
    } catch (const shoal::Error&) {
      refused = true;
    }
    EXPECT_TRUE(refused) << row.flag << " takes a name beside its choices";
  }
  // A checkpoint of a short run.
  const std::string dir = shoal::testing::make_small_dataset_dir(64, 16);
  const CliResult run = shoal_train("--model mlp --epochs 1 --batch-size 32 --threads 1 --no-progress "
                                    "--data-dir " + dir + " --checkpoint-dir " + dir + "/ckpt");
  ASSERT_EQ(run.exit_code, 0) << run.err;
  const auto point = shoal::checkpoint::load_latest_intact(dir + "/ckpt");
  fs::remove_all(dir);
  ASSERT_TRUE(point.has_value());
  const shoal::checkpoint::TrainingState& saved = point->state;
  shoal::train::TrainOptions run_options;
  run_options.model = "mlp";
  for (const shoal::train::TrainOption& row : shoal::train::train_option_table()) {
    if (row.key == nullptr || (row.saved_when && !row.saved_when(run_options))) continue;
    ASSERT_EQ(saved.config.count(row.key), 1u) << row.flag << "'s key " << row.key << " is not saved";
    const c10::IValue& value = saved.config.at(row.key);
    using shoal::train::SavedType;
    EXPECT_TRUE(row.type == SavedType::kInteger ? value.isInt()
                : row.type == SavedType::kNumber ? value.isDouble()
                                                 : value.isString())
        << row.key << " is saved as " << value.tagKind();
  }
  // The keys checkpoints have always had (old ones must still resume): none renamed or lost.
  std::set<std::string> keys;
  for (const auto& entry : saved.config) keys.insert(entry.first);
  EXPECT_EQ(keys, (std::set<std::string>{
                      "accumulate", "batch_size", "clip_grad_norm", "epochs", "gamma", "loss", "lr",
                      "lr_schedule", "milestones", "model", "momentum", "optimizer", "precision",
                      "seed", "step_size", "t_max", "warmup_start_factor", "warmup_steps",
                      "world_size"}));
  for (const auto& [key, value] : saved.config) {
    bool known = key == "world_size";
    for (const auto& row : shoal::train::train_option_table()) known |= row.key && key == row.key;
    EXPECT_TRUE(known) << "the checkpoint saves " << key << ", which no row of the table names";
  }
  // Each inheriting row reads back what it saved: another run's values give way to the saved.
  shoal::train::TrainOptions other;
  other.model = "mlp";
  other.lr = 0.5;
  other.momentum = 0.5;
  other.lr_schedule = ::shoal::train::LrSchedule::kCosine;
  other.optimizer = ::shoal::train::Optimizer::kAdam;
  other.batch_size = 7;
  other.epochs = 9;
  other.accumulate = 3;
  other.milestones = {5, 6};
  other.precision = ::shoal::train::Precision::kBf16;
  shoal::train::inherit_checkpoint_config(other, saved, {}, "checkpoint");
  for (const shoal::train::TrainOption& row : shoal::train::train_option_table()) {
    if (row.key == nullptr || row.on_resume == shoal::train::OnResume::kKeep ||
        row.on_resume == shoal::train::OnResume::kMustEqual ||
        (row.saved_when && !row.saved_when(run_options))) {
      continue;  // not inherited, or not saved by this run (the GPT's sizes)
    }
    EXPECT_EQ(row.get(other), saved.config.at(row.key)) << row.key << " was not inherited";
  }
}

// Histograms in the event files of a run of 469 steps, as many as an epoch of `make run` (60000
// images, 2 ranks of batch 64), with the default --histogram-interval; none with 0.
TEST(CliTrain, DefaultHistogramIntervalWritesHistogramsInADefaultLengthRun) {
  const std::string dir = shoal::testing::make_small_dataset_dir(469, 16);
  auto histograms = [&](const std::string& extra, const std::string& board) {
    const CliResult run = shoal_train("--model mlp --epochs 1 --batch-size 1 --lr 0.001 --threads 1 "
                                      "--log-interval 0 --no-progress --data-dir " + dir +
                                      " --tensorboard " + board + extra);
    EXPECT_EQ(run.exit_code, 0) << run.err;
    int count = 0;
    for (const auto& entry : fs::directory_iterator(board)) {
      const std::string events = slurp(entry.path().string());
      for (size_t at = events.find("parameters/"); at != std::string::npos;
           at = events.find("parameters/", at + 1)) {
        ++count;
      }
    }
    return count;
  };
  const int by_default = histograms("", dir + "/default");
  const int none = histograms(" --histogram-interval 0", dir + "/none");
  fs::remove_all(dir);
  EXPECT_GT(by_default, 0) << "the default --histogram-interval wrote no histogram in 469 steps";
  EXPECT_EQ(none, 0);
}

TEST(CliTrain, TrainsOnASmallDatasetAndReportsAccuracy) {
  const std::string dir = shoal::testing::make_small_dataset_dir(256, 64);
  const std::string metrics = dir + "/metrics.jsonl";
  const CliResult run = shoal_train("--model mlp --epochs 2 --batch-size 32 --threads 1 --log-interval 4 "
                              "--data-dir " + dir + " --metrics " + metrics);
  const std::string written = slurp(metrics);
  fs::remove_all(dir);
  ASSERT_EQ(run.exit_code, 0) << run.err;
  // The last stdout line is the result, with four decimals.
  const size_t last = run.out.rfind("final test accuracy: ");
  ASSERT_NE(last, std::string::npos) << run.out;
  const double accuracy = std::stod(run.out.substr(last + 21));
  // The test split repeats the first training images; chance is 0.1. Measured: 0.41 after these
  // two epochs (deterministic for the default seed). A trainer that learns nothing fails.
  EXPECT_GT(accuracy, 0.3);
  EXPECT_LE(accuracy, 1.0);
  EXPECT_EQ(run.out.find('\n', last), run.out.size() - 1);
  EXPECT_NE(run.out.find("epoch 2/2"), std::string::npos) << run.out;
  // stderr is not a terminal here: plain progress lines, no carriage returns.
  EXPECT_NE(run.err.find("step 4/8"), std::string::npos) << run.err;
  EXPECT_EQ(run.err.find('\r'), std::string::npos);
  // The header is an info message: shown at the default SHOAL_LOG_LEVEL.
  EXPECT_NE(run.err.find("shoal train: mlp ("), std::string::npos) << run.err;
  // The run line, then 8 steps per epoch, a step line every 4: 2 per epoch, and one epoch line
  // each.
  EXPECT_EQ(count_lines(written), 7) << written;
  EXPECT_EQ(written.rfind("{\"event\":\"run\",\"strategy\":\"single\",\"world_size\":1,", 0), 0u)
      << written;
  EXPECT_NE(written.find("\"event\":\"epoch\",\"epoch\":2"), std::string::npos) << written;
}

// --sync diloco trains Fashion-MNIST end to end: 2 ranks, AdamW inside, 8000 samples (63 steps
// of 64 per rank, a sync every 4). Measured 0.7465 test accuracy (DDP with the same flags 0.8225;
// chance 0.1); the run line names the sync; the 3 steps after the last sync are synchronised
// before the evaluation, so the ranks end with one model.
TEST(CliTrain, DiLoCoTrainsFashionMnistToASaneAccuracy) {
  SHOAL_SKIP_UNLESS(shoal::testing::have_real_fashion_mnist(), shoal::testing::Dependency::kDataset,
                    "Fashion-MNIST is not installed (apt-get install dataset-fashion-mnist)");
  const std::string dir = shoal::testing::make_temp_dir("shoal-cli-diloco");
  const std::string metrics = dir + "/metrics.jsonl";
  const CliResult run = shoal_train(
      "--strategy ddp --nproc-per-node 2 --sync diloco --sync-every 4 --optimizer adamw "
      "--lr 0.001 --model mlp --train-samples 8000 --test-samples 2000 --epochs 1 --threads 1 "
      "--no-progress --metrics " + metrics + " --dump-parameters " + dir + "/final");
  const std::string written = slurp(metrics);
  ASSERT_EQ(run.exit_code, 0) << run.err;
  const auto rank0 = shoal::checkpoint::load_state_dict_file(dir + "/final.rank0.pt");
  const auto rank1 = shoal::checkpoint::load_state_dict_file(dir + "/final.rank1.pt");
  fs::remove_all(dir);
  EXPECT_EQ(shoal::testing::max_relative_difference(rank0, rank1), 0) << "the replicas differ";
  const size_t last = run.out.rfind("final test accuracy: ");
  ASSERT_NE(last, std::string::npos) << run.out;
  EXPECT_GT(std::stod(run.out.substr(last + 21)), 0.65) << run.out;
  EXPECT_EQ(written.rfind("{\"event\":\"run\",\"strategy\":\"diloco\",\"world_size\":2,", 0), 0u)
      << written;
}

// --mesh tp=2 splits the built-in transformer by its own plan (Model::parallelize); with dp=1 the
// run is the one-process run: the same weights at the end.
TEST(CliTrain, MeshSplitsTheTransformerAndTrainsAsOneProcess) {
  SHOAL_SKIP_UNLESS(shoal::testing::have_real_fashion_mnist(), shoal::testing::Dependency::kDataset,
                    "Fashion-MNIST is not installed (apt-get install dataset-fashion-mnist)");
  const std::string dir = shoal::testing::make_temp_dir("shoal-cli-mesh");
  const std::string common = "--model transformer --train-samples 256 --test-samples 64 --epochs 1 "
                             "--batch-size 32 --threads 1 --no-progress --dump-parameters ";
  const CliResult single = shoal_train(common + dir + "/single");
  const CliResult mesh = shoal_train("--strategy ddp --nproc-per-node 2 --mesh tp=2 " + common + dir + "/mesh");
  ASSERT_EQ(single.exit_code, 0) << single.err;
  ASSERT_EQ(mesh.exit_code, 0) << mesh.err;
  const auto expected = shoal::checkpoint::load_state_dict_file(dir + "/single.rank0.pt");
  for (const char* rank : {"rank0", "rank1"}) {
    const auto split = shoal::checkpoint::load_state_dict_file(dir + "/mesh." + rank + ".pt");
    EXPECT_LT(shoal::testing::max_relative_difference(split, expected), 1e-5) << rank;
  }
  fs::remove_all(dir);
}

// What --sync localsgd/diloco cannot go with is refused before anything runs, in one line naming
// the flags.
TEST(CliTrain, SyncRefusalsAreOneLineNamingTheFlags) {
  const std::pair<const char*, const char*> cases[] = {
      {"--strategy fsdp --sync diloco", "--sync diloco applies to --strategy ddp"},
      {"--strategy pipeline --sync localsgd", "--sync localsgd applies to --strategy ddp"},
      {"--strategy ps --sync localsgd", "--sync localsgd applies to --strategy ddp"},
      {"--sync localsgd", "--sync localsgd applies to --strategy ddp"},
      {"--strategy ddp --sync localsgd --comm-hook fp16", "--comm-hook and --bucket-cap-mb"},
      {"--strategy ddp --sync localsgd --model-parallel 2", "does not go with --model-parallel"},
      {"--strategy ddp --sync diloco --resume --checkpoint-dir /nonexistent/ckpt",
       "--sync diloco cannot resume (--resume, --max-restarts)"},
      {"--strategy ddp --sync diloco --max-restarts 1",
       "--sync diloco cannot resume (--resume, --max-restarts)"},
      {"--strategy ddp --sync localsgd --device cuda", "--device cuda: --sync localsgd"},
  };
  for (const auto& [flags, expected] : cases) {
    SCOPED_TRACE(flags);
    const CliResult run = shoal_train(std::string(flags) + " --no-progress --data-dir /nonexistent");
    EXPECT_NE(run.exit_code, 0);
    EXPECT_EQ(count_lines(run.err), 1) << run.err;
    EXPECT_EQ(run.err.rfind("shoal: error: ", 0), 0u) << run.err;
    EXPECT_NE(run.err.find(expected), std::string::npos) << run.err;
  }
}

// Every --strategy names itself in the metrics run line and in TensorBoard's run text, by the name
// the user gave (`shoal plot` labels runs with it): a strategy that falls back on another's name
// mislabels the run.
TEST(CliTrain, RunLineAndTensorBoardTextNameEveryStrategy) {
  struct Case {
    const char* name;
    const char* flags;
    int world_size;
  };
  const Case cases[] = {
      {"single", "--strategy single", 1},
      {"ddp", "--strategy ddp --nproc-per-node 2", 2},
      {"ddp", "--strategy ddp --nproc-per-node 1 --model-parallel 2", 1},
      {"dp", "--strategy dp --replicas 2", 1},
      {"fsdp", "--strategy fsdp --nproc-per-node 2", 2},
      {"pipeline", "--strategy pipeline --stages 2", 2},
      {"ps", "--strategy ps --servers 1 --workers 2", 2},
  };
  const std::string dir = shoal::testing::make_small_dataset_dir(64, 32);
  for (const Case& c : cases) {
    SCOPED_TRACE(c.flags);
    const std::string metrics = dir + "/metrics.jsonl";
    const std::string board = dir + "/board";
    const CliResult run = shoal_train(std::string(c.flags) +
                                      " --model mlp --epochs 1 --batch-size 16 --threads 1 "
                                      "--no-progress --data-dir " + dir + " --metrics " + metrics +
                                      " --tensorboard " + board);
    const std::string written = slurp(metrics);
    std::string events;
    if (fs::is_directory(board)) {
      for (const auto& entry : fs::directory_iterator(board)) events += slurp(entry.path());
    }
    fs::remove(metrics);
    fs::remove_all(board);
    ASSERT_EQ(run.exit_code, 0) << run.err;
    const std::string line = std::string("{\"event\":\"run\",\"strategy\":\"") + c.name +
                             "\",\"world_size\":" + std::to_string(c.world_size) + ",";
    EXPECT_EQ(written.rfind(line, 0), 0u) << written;
    const std::string text = std::string("strategy ") + c.name + ", " +
                             std::to_string(c.world_size) +
                             (c.world_size == 1 ? " process," : " processes,");
    EXPECT_NE(events.find(text), std::string::npos) << "no '" << text << "' in the event file";
  }
  fs::remove_all(dir);
}

// Ranks srun starts train the job shoal's own launcher trains, to the bit: SLURM passes on the
// user's environment (here without OMP_NUM_THREADS, as usual), where shoal's launcher sets
// OMP_NUM_THREADS=1, from which OpenBLAS sized its thread pool, and its matrix products round
// differently with another count. The two ranks get by hand the variables srun -N1 -n2 sets (no
// SLURM daemon); the machine needs 2 cores for OpenBLAS's default to differ from 1.
TEST(CliTrain, SrunRanksTrainAsShoalsOwnLauncher) {
  const std::string dir = shoal::testing::make_small_dataset_dir(512, 64);
  const std::string common = "--strategy ddp --model mlp --epochs 1 --batch-size 32 --threads 1 "
                             "--seed 7 --no-progress --data-dir " + dir;
  const std::string unset = "env -u OMP_NUM_THREADS -u OPENBLAS_NUM_THREADS -u RANK -u "
                            "WORLD_SIZE -u LOCAL_RANK -u LOCAL_WORLD_SIZE -u MASTER_ADDR -u "
                            "MASTER_PORT ";
  const CliResult own = shoal_train(common + " --nproc-per-node 2 --dump-parameters " + dir + "/own",
                                    "-u OMP_NUM_THREADS -u OPENBLAS_NUM_THREADS");
  ASSERT_EQ(own.exit_code, 0) << own.err;
  const std::string port = std::to_string(shoal::testing::free_port());
  // Each rank bounded in time; the job succeeds when both do.
  std::string command;
  for (int rank = 0; rank < 2; ++rank) {
    const std::string r = std::to_string(rank);
    command += "timeout 240 " + unset + "SHOAL_TIMEOUT=60s SLURM_JOB_ID=4242 SLURM_STEP_ID=0 SLURM_PROCID=" + r + " SLURM_LOCALID=" +
               r + " SLURM_NODEID=0 SLURM_NTASKS=2 SLURM_STEP_NUM_TASKS=2 "
               "SLURM_STEP_TASKS_PER_NODE=2 SLURM_STEP_NODELIST=localhost MASTER_ADDR=127.0.0.1 "
               "MASTER_PORT=" + port + " SHOAL_AUTH_TOKEN=srun-test " + shoal_binary() + " train " +
               common + " --dump-parameters " + dir + "/srun >" + dir + "/srun.out" + r + " 2>" +
               dir + "/srun.err" + r + " & p" + r + "=$!; ";
  }
  command += "wait $p0; s0=$?; wait $p1; [ $? = 0 ] && [ $s0 = 0 ]";
  const int status = std::system(command.c_str());
  const std::string errors = slurp(dir + "/srun.err0") + slurp(dir + "/srun.err1");
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << errors;
  for (int rank = 0; rank < 2; ++rank) {
    const std::string name = "/srun.rank" + std::to_string(rank) + ".pt";
    const auto got = shoal::checkpoint::load_state_dict_file(dir + name);
    const auto want = shoal::checkpoint::load_state_dict_file(dir + "/own.rank" +
                                                             std::to_string(rank) + ".pt");
    EXPECT_EQ(shoal::testing::max_relative_difference(got, want), 0.0) << "rank " << rank;
  }
  fs::remove_all(dir);
}

int occurrences(const std::string& text, const std::string& part) {
  int count = 0;
  for (size_t at = text.find(part); at != std::string::npos; at = text.find(part, at + 1)) ++count;
  return count;
}

// SHOAL_LOG_LEVEL=warn silences Shoal's info messages (the header) but not the progress lines,
// the result on stdout, or the error line of a failing command; =debug adds the debug ones,
// among them one line per set of rules checked: each once, and a resume the saved rows again;
// a resume reads its checkpoint once (the options it inherits and the state it goes on from are
// one checkpoint's).
TEST(CliTrain, LogLevelFiltersDiagnosticsOnly) {
  const std::string dir = shoal::testing::make_small_dataset_dir(128, 32);
  const std::string ckpt = dir + "/ckpt";
  const std::string small = "--model mlp --epochs 1 --batch-size 32 --threads 1 --log-interval 2 "
                            "--data-dir " + dir;
  const CliResult quiet = shoal_train(small, "SHOAL_LOG_LEVEL=warn");
  const CliResult chatty = shoal_train(small + " --checkpoint-dir " + ckpt, "SHOAL_LOG_LEVEL=debug");
  const CliResult resumed = shoal_train(small + " --checkpoint-dir " + ckpt + " --resume --epochs 2",
                                        "SHOAL_LOG_LEVEL=debug");
  const CliResult failing = shoal_train("--batch-size 0 --no-progress", "SHOAL_LOG_LEVEL=off");
  // A given option's mistake is said before the checkpoint is looked for.
  const CliResult bad_resume = shoal_train(small + " --checkpoint-dir " + dir + "/none --resume --lr -1",
                                           "SHOAL_LOG_LEVEL=off");
  fs::remove_all(dir);
  EXPECT_NE(bad_resume.exit_code, 0);
  EXPECT_NE(bad_resume.err.find("learning rate must be"), std::string::npos) << bad_resume.err;
  EXPECT_EQ(bad_resume.err.find("no checkpoint"), std::string::npos) << bad_resume.err;
  ASSERT_EQ(resumed.exit_code, 0) << resumed.err;
  EXPECT_NE(resumed.err.find("changed from the checkpoint: epochs 1 -> 2"), std::string::npos)
      << resumed.err;
  EXPECT_EQ(occurrences(resumed.err, "shoal: --resume read "), 1) << resumed.err;
  const std::string options = "shoal: checked the training options";
  const std::vector<std::pair<std::string, int>> once_each[] = {
      {{options + "\n", 1}, {"shoal: checked --sync\n", 1},
       {"shoal: checked the strategy's settings\n", 1}},
      {{options + "\n", 1}, {options + " a checkpoint holds\n", 1}, {"shoal: checked --sync\n", 1},
       {"shoal: checked the strategy's settings\n", 1}}};
  for (int r = 0; r < 2; ++r) {
    const CliResult& run = r == 0 ? chatty : resumed;
    for (const auto& [rules, times] : once_each[r]) {
      EXPECT_EQ(occurrences(run.err, rules), times) << rules << run.err;
    }
  }
  ASSERT_EQ(quiet.exit_code, 0) << quiet.err;
  EXPECT_EQ(quiet.err.find("shoal train: mlp ("), std::string::npos) << quiet.err;
  EXPECT_NE(quiet.err.find("step 2/4"), std::string::npos) << quiet.err;
  EXPECT_NE(quiet.out.find("final test accuracy: "), std::string::npos) << quiet.out;

  ASSERT_EQ(chatty.exit_code, 0) << chatty.err;
  EXPECT_NE(chatty.err.find("shoal train: mlp ("), std::string::npos) << chatty.err;
  EXPECT_NE(chatty.err.find("shoal: saved checkpoint " + ckpt + "/"), std::string::npos) << chatty.err;

  EXPECT_EQ(failing.exit_code, 2);
  EXPECT_EQ(count_lines(failing.err), 1) << failing.err;
  EXPECT_EQ(failing.err.rfind("shoal: error: ", 0), 0u) << failing.err;
}

}  // namespace test_cli_train
