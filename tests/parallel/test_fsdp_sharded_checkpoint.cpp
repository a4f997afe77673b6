// Sharded checkpoints (`shoal train --strategy fsdp --checkpoint-format sharded`) as a user runs
// them: saved by 2 ranks, a resume at 2, 3 and 1 ranks continues to the weights and Adam state of
// the run that was not sharded (at 2: the uninterrupted run; at 3 and 1: the same resume from the
// full checkpoint, which holds the exact state); `shoal ckpt convert` writes a file torch.load
// reads and loads strictly; sets of files that disagree are refused in one line naming the file,
// and a damaged newest checkpoint falls back to the previous one.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <torch/torch.h>

#include <cstdlib>
#include <filesystem>

#include "shoal/checkpoint/checkpoint_manager.h"
#include "shoal/checkpoint/serialization.h"
#include "shoal/checkpoint/sharded_checkpoint.h"
#include "shoal/error.h"
#include "testing/dependencies.h"
#include "testing/multi_rank.h"
#include "testing/python.h"
#include "testing/shoal_cli.h"

namespace test_fsdp_sharded_checkpoint {

namespace fs = std::filesystem;
namespace ckpt = shoal::checkpoint;

// Trains the MLP with Adam on 256 samples (8 steps of 2 x 16 an epoch at 2 ranks) under
// `--strategy fsdp --shard 3` on `ranks` processes, checkpointing into `dir`. One thread each: a
// lone rank would otherwise get both cores, and how the work is split between threads is what can
// differ between two runs of the same checkpoint (once 1.7e-5 apart at 1 rank on the 2.15 leg,
// the machine loaded; 0 in the reruns).
void train(int ranks, const std::string& dir, const std::string& more) {
  const std::string err = shoal::testing::temp_path("shoal-fsdp-sharded") + ".err";
  const std::string command =
      shoal::testing::shoal_cli_with_dataset() + " train --strategy fsdp --shard 3 --nproc-per-node " +
      std::to_string(ranks) + " --model mlp --optimizer adam --lr 0.001 --train-samples 256 --threads 1"
      " --test-samples 32 --batch-size 16 --no-progress --checkpoint-keep 0 --checkpoint-dir " + dir +
      " " + more + " >/dev/null 2>" + err;
  const int status = std::system(command.c_str());
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
      << command << "\n" << shoal::testing::read_file(err);
  fs::remove(err);
}

double relative_difference(const at::Tensor& got, const at::Tensor& want) {
  if (got.sizes() != want.sizes()) return INFINITY;
  return (got.to(at::kDouble) - want.to(at::kDouble)).abs().max().item<double>() /
         std::max(want.abs().max().item<double>(), 1e-12);
}

// The largest relative difference over the weights and every optimizer state tensor.
double max_relative_difference(const ckpt::TrainingState& got, const ckpt::TrainingState& want,
                               const std::string& what) {
  double worst = 0;
  EXPECT_EQ(got.model.size(), want.model.size()) << what;
  for (const auto& item : want.model) {
    const at::Tensor* other = got.model.find(item.key());
    EXPECT_NE(other, nullptr) << what << ": " << item.key();
    if (other != nullptr) worst = std::max(worst, relative_difference(*other, item.value()));
  }
  EXPECT_EQ(got.optimizer.state.size(), want.optimizer.state.size()) << what;
  EXPECT_FALSE(want.optimizer.state.empty()) << what;
  for (const auto& [index, fields] : want.optimizer.state) {
    auto it = got.optimizer.state.find(index);
    EXPECT_NE(it, got.optimizer.state.end()) << what << ": parameter " << index;
    if (it == got.optimizer.state.end()) continue;
    EXPECT_EQ(it->second.size(), fields.size()) << what;
    for (const auto& [name, tensor] : fields) {
      auto field = it->second.find(name);
      EXPECT_NE(field, it->second.end()) << what << ": " << name;
      if (field != it->second.end()) worst = std::max(worst, relative_difference(field->second, tensor));
    }
  }
  EXPECT_EQ(got.step, want.step) << what;
  EXPECT_EQ(got.epoch, want.epoch) << what;
  return worst;
}

ckpt::TrainingState latest(const std::string& dir) {
  auto path = ckpt::find_latest(dir);
  EXPECT_TRUE(path.has_value()) << dir;
  return ckpt::load_training_state(path.value_or(dir + "/none"));
}

class ShardedCheckpoint : public ::testing::Test {
 protected:
  // One 2-rank epoch saved both ways, shared by the tests (the slow part).
  static void SetUpTestSuite() {
    root_ = shoal::testing::temp_path("shoal-fsdp-sharded");
    train(2, root_ + "/full", "--epochs 1");
    train(2, root_ + "/sharded", "--epochs 1 --checkpoint-format sharded");
  }
  static void TearDownTestSuite() { fs::remove_all(root_); }

  static std::string copy_of(const std::string& name, const std::string& as) {
    const std::string to = root_ + "/" + as;
    fs::remove_all(to);
    fs::copy(root_ + "/" + name, to, fs::copy_options::recursive);
    return to;
  }
  static std::string sharded_folder() { return root_ + "/sharded/checkpoint_000000.sharded"; }

  static std::string root_;
};
std::string ShardedCheckpoint::root_;

TEST_F(ShardedCheckpoint, AssemblesToTheFullCheckpoint) {
  ASSERT_TRUE(fs::exists(sharded_folder() + "/rank_0.pt"));
  ASSERT_TRUE(fs::exists(sharded_folder() + "/rank_1.pt"));
  const double difference =
      max_relative_difference(latest(root_ + "/sharded"), latest(root_ + "/full"), "assembled");
  std::printf("sharded checkpoint assembled vs full checkpoint: max relative difference %.3g\n",
              difference);
  EXPECT_LE(difference, 1e-6);
  // What --init-from reads from it: the whole model.
  const ckpt::StateDict model = ckpt::load_state_dict_file(sharded_folder());
  const ckpt::TrainingState full = latest(root_ + "/full");
  ASSERT_EQ(model.size(), full.model.size());
  for (const auto& item : full.model) {
    EXPECT_TRUE(model[item.key()].equal(item.value())) << item.key();
  }
}

TEST_F(ShardedCheckpoint, ResumesAtTwoThreeAndOneRanksAsTheUnshardedRun) {
  // At 2 ranks: the uninterrupted 2-epoch run.
  train(2, root_ + "/uninterrupted", "--epochs 2");
  const std::string at2 = copy_of("sharded", "at2");
  train(2, at2, "--epochs 2 --resume --checkpoint-format sharded");
  const double d2 = max_relative_difference(latest(at2), latest(root_ + "/uninterrupted"), "at 2");
  std::printf("saved at 2, resumed at 2 (sharded) vs uninterrupted: max relative difference %.3g\n", d2);
  EXPECT_LE(d2, 1e-6);
  // At 3 and 1: what the full checkpoint, which holds the whole state, continues to.
  for (int ranks : {3, 1}) {
    const std::string n = std::to_string(ranks);
    const std::string full = copy_of("full", "full-at" + n);
    train(ranks, full, "--epochs 2 --resume");
    const std::string sharded = copy_of("sharded", "sharded-at" + n);
    train(ranks, sharded, "--epochs 2 --resume --checkpoint-format sharded");
    // The resumed run saved its own sharded checkpoint at the new world size.
    EXPECT_TRUE(fs::exists(sharded + "/checkpoint_000001.sharded/rank_" + std::to_string(ranks - 1) + ".pt"));
    const double d = max_relative_difference(latest(sharded), latest(full), "at " + n);
    std::printf("saved at 2, resumed at %d (sharded) vs resumed from the full checkpoint: max "
                "relative difference %.3g\n", ranks, d);
    EXPECT_LE(d, 1e-6) << ranks << " ranks";
  }
}

TEST_F(ShardedCheckpoint, ConvertWritesWhatTorchLoadReadsStrictly) {
  const std::string out = root_ + "/converted.pt";
  const auto convert = shoal::testing::run_command(shoal::testing::shoal_cli_with_dataset() +
                                                   " ckpt convert " + sharded_folder() + " " + out);
  ASSERT_TRUE(convert.ok()) << convert.describe();
  const auto inspect = shoal::testing::run_command(shoal::testing::shoal_cli_with_dataset() +
                                                   " ckpt inspect " + sharded_folder());
  ASSERT_TRUE(inspect.ok()) << inspect.describe();
  EXPECT_NE(inspect.out.find("sharded training checkpoint"), std::string::npos) << inspect.out;
  EXPECT_NE(inspect.out.find("fc1.weight: [1024, 784] float32"), std::string::npos) << inspect.out;
  const std::string code =
      std::string(shoal::testing::kImportTorchOrExit) +
      "import torch.nn as nn\n"
      "d = torch.load(sys.argv[1])\n"
      "m = nn.Module(); m.fc1 = nn.Linear(784, 1024); m.fc2 = nn.Linear(1024, 1024)\n"
      "m.fc3 = nn.Linear(1024, 10)\n"
      "m.load_state_dict(d['model'], strict=True)\n"
      "o = torch.optim.Adam(m.parameters(), lr=0.001)\n"
      "o.load_state_dict(d['optimizer'])\n"
      "ps = list(m.parameters())\n"
      "assert len(o.state) == len(ps), len(o.state)\n"
      "for p in ps:\n"
      "    s = o.state[p]\n"
      "    assert s['exp_avg'].shape == p.shape and s['exp_avg_sq'].shape == p.shape\n"
      "    assert float(s['step']) == 8.0, s['step']\n"
      "assert d['world_size'] == 2 and d['step'] == 8, (d['world_size'], d['step'])\n"
      "print('ORACLE OK torch.load read the converted sharded checkpoint', flush=True)\n";
  const auto oracle = shoal::testing::run_python({"-c", code, out});
  if (oracle.exit_code == shoal::testing::kNoTorchExitCode) {
    SHOAL_SKIP_TEST(shoal::testing::Dependency::kPythonTorch, "/usr/bin/python3 has no torch");
  }
  EXPECT_TRUE(shoal::testing::oracle_succeeded(oracle));
  // One rank's file alone is a piece of the model: refused, naming the folder to pass.
  const auto piece = shoal::testing::run_command(shoal::testing::shoal_cli_with_dataset() + " ckpt convert " +
                                                 sharded_folder() + "/rank_1.pt " + root_ + "/piece.pt");
  EXPECT_FALSE(piece.ok());
  EXPECT_NE(piece.err.find("pass its folder"), std::string::npos) << piece.err;
  EXPECT_FALSE(fs::exists(root_ + "/piece.pt"));
}

TEST(ShardedCheckpointCli, RefusesTheFormatWithoutFsdp) {
  const auto result = shoal::testing::run_command(
      shoal::testing::shoal_cli_with_dataset() + " train --strategy ddp --nproc-per-node 2 "
      "--checkpoint-dir " + shoal::testing::temp_path("shoal-fsdp-sharded") + " --checkpoint-format sharded");
  EXPECT_FALSE(result.ok());
  EXPECT_NE(result.err.find("--checkpoint-format sharded applies to --strategy fsdp"), std::string::npos)
      << result.err;
}

// Loading `folder` throws a CheckpointError whose message holds every piece of `expected`.
void expect_refused(const std::string& folder, const std::vector<std::string>& expected) {
  try {
    ckpt::load_training_state(folder);
    ADD_FAILURE() << folder << " loaded";
  } catch (const shoal::CheckpointError& e) {
    const std::string message = e.what();
    std::printf("refused: %s\n", message.c_str());
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
    for (const auto& part : expected) EXPECT_NE(message.find(part), std::string::npos) << message;
  }
}

TEST_F(ShardedCheckpoint, RefusesSetsThatDisagree) {
  const std::string name = "checkpoint_000000.sharded";
  {  // A missing rank file.
    const std::string dir = copy_of("sharded", "missing") + "/" + name;
    fs::remove(dir + "/rank_1.pt");
    expect_refused(dir, {"rank_1.pt", "is missing", "saved by 2 ranks"});
    fs::remove(dir + "/rank_0.pt");
    expect_refused(dir, {"lacks rank_0.pt"});
  }
  {  // A file beyond the world size: another save's.
    const std::string dir = copy_of("sharded", "extra") + "/" + name;
    fs::copy_file(dir + "/rank_1.pt", dir + "/rank_2.pt");
    expect_refused(dir, {"rank_2.pt", "mixes two saves"});
  }
  {  // Rank 1's file saved at another world size.
    const std::string dir = copy_of("sharded", "other-world") + "/" + name;
    ckpt::ShardedTrainingState s = ckpt::load_shard(dir + "/rank_1.pt");
    s.world_size = 3;
    for (auto& unit : s.units) unit.padded = (unit.numel + 2) / 3 * 3;
    for (size_t u = 0; u < s.units.size(); ++u) {
      s.flat_param_shards[u] = at::zeros({s.units[u].padded / 3});
      for (auto& [field, t] : s.optimizer_shards[u]) {
        if (field != "step") t = at::zeros({s.units[u].padded / 3});
      }
    }
    ckpt::save_shard(s, dir + "/rank_1.pt");
    expect_refused(dir, {"rank_1.pt", "rank 1 of 3", "mixes two saves"});
  }
  {  // A piece of the wrong size (the metadata says otherwise).
    const std::string dir = copy_of("sharded", "wrong-size") + "/" + name;
    ckpt::ShardedTrainingState s = ckpt::load_shard(dir + "/rank_1.pt");
    s.flat_param_shards[0] = s.flat_param_shards[0].narrow(0, 0, 10).clone();
    ckpt::save_shard(s, dir + "/rank_1.pt");
    expect_refused(dir, {"rank_1.pt", "holds 10 elements"});
  }
  {  // Metadata that does not add up (a corrupt shape): refused before anything is allocated.
    const std::string dir = copy_of("sharded", "bad-shape") + "/" + name;
    ckpt::ShardedTrainingState s = ckpt::load_shard(dir + "/rank_1.pt");
    s.units[0].shapes[0] = {int64_t{1} << 40, int64_t{1} << 40};
    ckpt::save_shard(s, dir + "/rank_1.pt");
    expect_refused(dir, {"rank_1.pt", "does not fit"});
  }
  {  // Rank 1's file of a later save (another step).
    const std::string dir = copy_of("sharded", "other-step") + "/" + name;
    ckpt::ShardedTrainingState s = ckpt::load_shard(dir + "/rank_1.pt");
    s.replicated.step += 8;
    ckpt::save_shard(s, dir + "/rank_1.pt");
    expect_refused(dir, {"rank_1.pt", "disagrees with", "mixes two saves"});
  }
  // One rank's file read as a whole checkpoint: refused, naming what to pass.
  expect_refused(sharded_folder() + "/rank_0.pt", {"rank_0.pt", "sharded checkpoint", "folder"});
}

// A newest sharded checkpoint that lost a rank file (a save cut short, a copy that missed one) is
// passed over: the resume takes the previous checkpoint, which nothing has touched.
TEST_F(ShardedCheckpoint, ADamagedNewestCheckpointFallsBackToThePrevious) {
  const std::string dir = copy_of("sharded", "fallback");
  const std::string newer = dir + "/checkpoint_000001.sharded";
  fs::copy(dir + "/checkpoint_000000.sharded", newer, fs::copy_options::recursive);
  {
    std::FILE* f = std::fopen((dir + "/latest").c_str(), "w");
    std::fputs("checkpoint_000001.sharded\n", f);
    std::fclose(f);
  }
  fs::remove(newer + "/rank_1.pt");
  auto point = ckpt::load_latest_intact(dir);
  ASSERT_TRUE(point.has_value());
  EXPECT_EQ(point->path, dir + "/checkpoint_000000.sharded");
  ASSERT_EQ(point->skipped.size(), 1u);
  EXPECT_NE(point->skipped[0].find("rank_1.pt"), std::string::npos) << point->skipped[0];
  EXPECT_EQ(point->state.step, 8);
}

}  // namespace test_fsdp_sharded_checkpoint
