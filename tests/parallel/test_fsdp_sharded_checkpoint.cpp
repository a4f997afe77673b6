// Sharded checkpoints (`shoal train --strategy fsdp --checkpoint-format sharded`) as a user runs
// them: saved by 2 ranks, a resume at 2, 3 and 1 ranks continues to the weights and Adam state of
// the run that was not sharded (at 2: the uninterrupted run; at 3 and 1: the same resume from the
// full checkpoint, which holds the exact state); `shoal ckpt convert` writes a file torch.load
// reads and loads strictly; sets of files that disagree are refused in one line naming the file,
// and a damaged newest checkpoint falls back to the previous one. The folder is a DCP checkpoint:
// PyTorch 2.x loads it into a plain and an FSDP2 model, and PyTorch's FSDP2 checkpoint starts
// Shoal at 3 ranks.
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
    run_pytorch_oracle();
  }
  static void TearDownTestSuite() {
    fs::remove_all(root_);
    delete oracle_;
    oracle_ = nullptr;
  }

  // PyTorch 2.x reads the sharded folder and writes its own FSDP2 checkpoint into root_/pytorch
  // (sharded_dcp_oracle.py), in one run: each run costs seconds importing torch.
  static void run_pytorch_oracle() {
    const std::string python = shoal::testing::torch2_python();
    const char* source = std::getenv("SHOAL_SOURCE_DIR");
    if (python.empty() || source == nullptr) return;
    const std::string full = root_ + "/for-pytorch.pt";
    auto result = shoal::testing::run_command(shoal::testing::shoal_cli_with_dataset() + " ckpt convert " +
                                              sharded_folder() + " " + full);
    if (result.ok()) {
      fs::create_directories(pytorch_dir());
      const std::string script = std::string(source) + "/tests/parallel/sharded_dcp_oracle.py";
      // Bounded: a PyTorch run that hangs (its 2 ranks' rendezvous) fails the test instead.
      result = shoal::testing::run_command("OMP_NUM_THREADS=1 timeout 300 env " + python + " " + script + " " +
                                           sharded_folder() + " " + full + " " + pytorch_dir());
    }
    oracle_ = new shoal::testing::PythonResult(result);
  }
  static constexpr const char* kNoOracle =
      "PyTorch 2.x not installed (scripts/setup_torch_pypi.sh), or SHOAL_SOURCE_DIR is not set (run "
      "through ctest)";
  // The oracle's run, or a skip where PyTorch 2.x is missing.
  static bool oracle_ran() {
    if (oracle_ == nullptr) return false;
    EXPECT_TRUE(shoal::testing::oracle_succeeded(*oracle_));
    return true;
  }
  static std::string pytorch_dir() { return root_ + "/pytorch"; }

  static std::string copy_of(const std::string& name, const std::string& as) {
    const std::string to = root_ + "/" + as;
    fs::remove_all(to);
    fs::copy(root_ + "/" + name, to, fs::copy_options::recursive);
    return to;
  }
  static std::string sharded_folder() { return root_ + "/sharded/checkpoint_000000.sharded"; }

  static std::string root_;
  static shoal::testing::PythonResult* oracle_;
};
std::string ShardedCheckpoint::root_;
shoal::testing::PythonResult* ShardedCheckpoint::oracle_ = nullptr;

TEST_F(ShardedCheckpoint, AssemblesToTheFullCheckpoint) {
  ASSERT_TRUE(fs::exists(sharded_folder() + "/__0_0.distcp"));
  ASSERT_TRUE(fs::exists(sharded_folder() + "/__1_0.distcp"));
  ASSERT_TRUE(fs::exists(sharded_folder() + "/.metadata"));
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

void expect_refused(const std::string& folder, const std::vector<std::string>& expected);

TEST_F(ShardedCheckpoint, ResumesAtTwoThreeAndOneRanksAsTheUnshardedRun) {
  // At 2 ranks: the uninterrupted 2-epoch run.
  train(2, root_ + "/uninterrupted", "--epochs 2");
  const std::string at2 = copy_of("sharded", "at2");
  train(2, at2, "--epochs 2 --resume --checkpoint-format sharded");
  const double d2 = max_relative_difference(latest(at2), latest(root_ + "/uninterrupted"), "at 2");
  std::printf("saved at 2, resumed at 2 (sharded) vs uninterrupted: max relative difference %.3g\n", d2);
  EXPECT_LE(d2, 1e-6);
  {  // Rank 1's file of the resumed run's save beside rank 0's of the first: named as another save's.
    const std::string mixed = copy_of("sharded/checkpoint_000000.sharded", "mixed");
    fs::copy_file(at2 + "/checkpoint_000001.sharded/__1_0.distcp", mixed + "/__1_0.distcp",
                  fs::copy_options::overwrite_existing);
    expect_refused(mixed, {"__1_0.distcp", "is a file of another save"});
  }
  // At 3 and 1: what the full checkpoint, which holds the whole state, continues to.
  for (int ranks : {3, 1}) {
    const std::string n = std::to_string(ranks);
    const std::string full = copy_of("full", "full-at" + n);
    train(ranks, full, "--epochs 2 --resume");
    const std::string sharded = copy_of("sharded", "sharded-at" + n);
    train(ranks, sharded, "--epochs 2 --resume --checkpoint-format sharded");
    // The resumed run saved its own sharded checkpoint at the new world size.
    EXPECT_TRUE(fs::exists(sharded + "/checkpoint_000001.sharded/__" + std::to_string(ranks - 1) + "_0.distcp"));
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
  // One rank's file alone is a piece of the model: refused, naming it.
  const auto piece = shoal::testing::run_command(shoal::testing::shoal_cli_with_dataset() + " ckpt convert " +
                                                 sharded_folder() + "/__1_0.distcp " + root_ + "/piece.pt");
  EXPECT_FALSE(piece.ok());
  EXPECT_NE(piece.err.find("__1_0.distcp"), std::string::npos) << piece.err;
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
    fs::remove(dir + "/__1_0.distcp");
    expect_refused(dir, {"__1_0.distcp"});
  }
  {  // Rank 0's file in rank 1's place: its chunks are not where .metadata says.
    const std::string dir = copy_of("sharded", "swapped") + "/" + name;
    fs::copy_file(dir + "/__0_0.distcp", dir + "/__1_0.distcp", fs::copy_options::overwrite_existing);
    expect_refused(dir, {"__1_0.distcp"});
  }
  {  // A rank file cut short.
    const std::string dir = copy_of("sharded", "short") + "/" + name;
    fs::resize_file(dir + "/__1_0.distcp", fs::file_size(dir + "/__1_0.distcp") / 2);
    expect_refused(dir, {"__1_0.distcp", "truncated"});
  }
  {  // No .metadata: a save that never completed.
    const std::string dir = copy_of("sharded", "headless") + "/" + name;
    fs::remove(dir + "/.metadata");
    expect_refused(dir, {name, "no .metadata", "interrupted"});
  }
}

// PyTorch 2.x reads the folder as the DCP checkpoint it is: dcp.load fills an unsharded state
// dict and an FSDP2 model on 2 ranks (model and Adam state, by get_state_dict's keys) with what
// Shoal reads from it, bit for bit (sharded_dcp_oracle.py).
TEST_F(ShardedCheckpoint, LoadsIntoPyTorchPlainAndFsdp2) {
  if (!oracle_ran()) SHOAL_SKIP_TEST(shoal::testing::Dependency::kOptional, kNoOracle);
  EXPECT_NE(oracle_->out.find("fsdp2: 2 ranks loaded"), std::string::npos) << oracle_->out;
  std::printf("%s", oracle_->out.c_str());
}

// `got` against PyTorch's {"model": state dict, <optim>: {"state": {name: {field: tensor}}}}, the
// optimizer's parameters numbered in the model's order: the largest relative difference of the
// weights at most `weights`, of the optimizer state at most `state` (0: equal bit for bit).
void expect_state_near(const ckpt::TrainingState& got, const c10::IValue& want, const std::string& optim,
                       double weights, double state) {
  const auto dict = want.toGenericDict();
  const auto model = dict.at(std::string("model")).toGenericDict();
  const auto fields_by_name = dict.at(optim).toGenericDict().at(std::string("state")).toGenericDict();
  ASSERT_EQ(got.model.size(), model.size());
  ASSERT_EQ(got.optimizer.state.size(), model.size());
  double worst_weights = 0;
  double worst_state = 0;
  int64_t index = 0;
  for (const auto& item : model) {
    const std::string name = item.key().toStringRef();
    ASSERT_NE(got.model.find(name), nullptr) << name;
    worst_weights = std::max(worst_weights, relative_difference(got.model[name], item.value().toTensor()));
    for (const auto& field : fields_by_name.at(name).toGenericDict()) {
      const auto& fields = got.optimizer.state.at(index);
      auto it = fields.find(field.key().toStringRef());
      ASSERT_NE(it, fields.end()) << name << " " << field.key().toStringRef();
      worst_state = std::max(worst_state, relative_difference(it->second, field.value().toTensor()));
    }
    ++index;
  }
  std::printf("against PyTorch's: max relative difference %.3g (weights), %.3g (optimizer state)\n",
              worst_weights, worst_state);
  EXPECT_LE(worst_weights, weights);
  EXPECT_LE(worst_state, state);
}

// PyTorch's FSDP2 checkpoint (2 ranks, 3 Adam steps, dcp.save of get_state_dict) starts
// `shoal train --strategy fsdp --nproc-per-node 3 --init-from FOLDER`: --init-from, not --resume,
// as the folder holds no epoch, sampler or config of a Shoal run to continue, but a DCP folder's
// optimizer state starts the optimizer too. Shoal reads the weights and Adam state bit for bit,
// and its first step equals PyTorch's next one (sharded_dcp_oracle.py writes both).
TEST_F(ShardedCheckpoint, Fsdp2CheckpointStartsShoalAtThreeRanks) {
  if (!oracle_ran()) SHOAL_SKIP_TEST(shoal::testing::Dependency::kOptional, kNoOracle);
  const std::string out = pytorch_dir();
  // Shoal's reading of the folder equals the saved state gathered whole, bit for bit.
  expect_state_near(ckpt::load_training_state(out + "/ckpt"), ckpt::load(out + "/saved.pt"), "optim", 0, 0);

  const std::string command = " train --strategy fsdp --shard 3 --nproc-per-node 3 --model mlp "
                              "--optimizer adam --lr 0.001 --data " + out + "/data.pt --batch-size 16 "
                              "--epochs 1 --threads 1 --no-progress --init-from " + out + "/ckpt "
                              "--checkpoint-dir " + out + "/shoal";
  const auto trained = shoal::testing::run_command(shoal::testing::shoal_cli_with_dataset() + command);
  ASSERT_TRUE(trained.ok()) << trained.describe();
  // One step over the 48 samples at 3 ranks against PyTorch's over them in one batch: the Adam
  // state to 1e-6, the weights to 1e-5 (where Adam divides by a small sqrt(v), the gradient's
  // rounding, summed over 3 ranks here and in one batch there, is magnified: 6.6e-6 measured on
  // fc2.weight, the moments 1.6e-7).
  expect_state_near(ckpt::load_training_state(out + "/shoal/checkpoint_000000.pt"), ckpt::load(out + "/next.pt"),
                    "optim", 1e-5, 1e-6);
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
  fs::remove(newer + "/__1_0.distcp");
  auto point = ckpt::load_latest_intact(dir);
  ASSERT_TRUE(point.has_value());
  EXPECT_EQ(point->path, dir + "/checkpoint_000000.sharded");
  ASSERT_EQ(point->skipped.size(), 1u);
  EXPECT_NE(point->skipped[0].find("__1_0.distcp"), std::string::npos) << point->skipped[0];
  EXPECT_EQ(point->state.step, 8);
}

}  // namespace test_fsdp_sharded_checkpoint
