// Resuming: save → load → continue is bit-identical to training straight through; checkpoints are
// written atomically (a writer killed at any moment leaves a loadable latest checkpoint); the last
// K are kept; distributed saves are written by rank 0 only; the CLI inspects and converts.
#include <gtest/gtest.h>

#include <algorithm>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <random>

#include "checkpoint_testing.h"
#include "shoal/checkpoint/checkpoint_manager.h"
#include "shoal/comm/init.h"
#include "shoal/comm/process_group.h"
#include "shoal/comm/store.h"
#include "shoal/error.h"
#include "testing/multi_rank.h"

namespace shoal::checkpoint {
namespace test_checkpoint_resume {

using shoal::testing::compare_state_dicts;
using shoal::testing::make_net;

class CheckpointResume : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = shoal::testing::temp_dir("ckpt-resume"); }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string dir_;
};

/// `steps` optimizer steps on batches drawn from torch's default generator.
void train(torch::nn::Sequential& net, torch::optim::Optimizer& optimizer, int steps) {
  net->train();
  for (int i = 0; i < steps; ++i) {
    const auto x = torch::randn({16, 4});
    const auto y = torch::randint(0, 3, {16});
    optimizer.zero_grad();
    torch::nn::functional::cross_entropy(net->forward(x), y).backward();
    optimizer.step();
  }
}

template <typename Optimizer, typename Options>
void check_resume_is_bit_identical(const std::string& dir, const Options& options) {
  constexpr int kBefore = 5;  // steps before the checkpoint
  constexpr int kAfter = 4;   // steps after it

  torch::manual_seed(7);
  auto straight = make_net();
  Optimizer straight_opt(straight->parameters(), options);
  train(straight, straight_opt, kBefore + kAfter);

  torch::manual_seed(7);
  auto first = make_net();
  Optimizer first_opt(first->parameters(), options);
  train(first, first_opt, kBefore);
  TrainingState state = capture(*first, &first_opt);
  state.step = kBefore;
  CheckpointManager manager(dir, 2);
  manager.save(state);

  // A fresh process would start from other weights and another generator state.
  torch::manual_seed(999);
  auto resumed = make_net();
  Optimizer resumed_opt(resumed->parameters(), options);
  auto loaded = manager.load_latest();
  ASSERT_TRUE(loaded.has_value());
  EXPECT_EQ(loaded->step, kBefore);
  restore(*loaded, *resumed, &resumed_opt);
  train(resumed, resumed_opt, kAfter);

  EXPECT_EQ(compare_state_dicts(shoal::checkpoint::state_dict(*resumed),
                                shoal::checkpoint::state_dict(*straight)),
            "");
}

TEST_F(CheckpointResume, SgdMomentumResumesBitIdentically) {
  check_resume_is_bit_identical<torch::optim::SGD>(
      dir_, torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(1e-4));
}

TEST_F(CheckpointResume, NesterovResumesBitIdentically) {
  check_resume_is_bit_identical<torch::optim::SGD>(
      dir_, torch::optim::SGDOptions(0.1).momentum(0.9).nesterov(true));
}

TEST_F(CheckpointResume, AdamResumesBitIdentically) {
  check_resume_is_bit_identical<torch::optim::Adam>(dir_, torch::optim::AdamOptions(0.01));
}

TEST_F(CheckpointResume, AdamWAmsgradResumesBitIdentically) {
  check_resume_is_bit_identical<torch::optim::AdamW>(dir_, torch::optim::AdamWOptions(0.01).amsgrad(true));
}

TEST_F(CheckpointResume, KeepsLastK) {
  CheckpointManager manager(dir_, 2);
  EXPECT_FALSE(manager.load_latest().has_value());
  TrainingState state;
  state.model.insert("w", torch::zeros({3}));
  for (int i = 0; i < 5; ++i) {
    state.step = i * 10;
    state.model["w"].fill_(i);
    const std::string path = manager.save(state);
    EXPECT_EQ(find_latest(dir_).value(), path);
  }
  const auto files = manager.list();
  ASSERT_EQ(files.size(), 2u);
  EXPECT_EQ(files[0], dir_ + "/checkpoint_000003.pt");
  EXPECT_EQ(files[1], dir_ + "/checkpoint_000004.pt");
  const auto latest = manager.load_latest();
  ASSERT_TRUE(latest.has_value());
  EXPECT_EQ(latest->step, 40);
  EXPECT_TRUE(at::equal(latest->model["w"], torch::full({3}, 4.0)));
  EXPECT_EQ(latest->shoal_version, "0.1.0");

  // Without the pointer the highest number is found.
  std::filesystem::remove(dir_ + "/latest");
  EXPECT_EQ(find_latest(dir_).value(), dir_ + "/checkpoint_000004.pt");
}

// CheckpointManagerOptions: a prefix of one's own names the files (and only those count as
// checkpoints); keep_last = 0 keeps every one.
TEST_F(CheckpointResume, ManagerOptionsPrefixAndKeepAll) {
  CheckpointManagerOptions options;
  options.prefix = "run7_";
  options.keep_last = 0;
  CheckpointManager manager(dir_, options);
  CheckpointManager other(dir_, 1);  // default prefix, in the same folder
  TrainingState state;
  state.model.insert("w", torch::zeros({2}));
  for (int i = 0; i < 4; ++i) {
    state.step = i;
    EXPECT_EQ(manager.save(state), dir_ + "/run7_00000" + std::to_string(i) + ".pt");
  }
  EXPECT_EQ(CheckpointManager(dir_, options).latest_path().value(), dir_ + "/run7_000003.pt");
  state.step = 100;
  other.save(state);
  const auto files = manager.list();
  ASSERT_EQ(files.size(), 4u) << "keep_last = 0 deleted some, or another prefix was counted";
  EXPECT_EQ(files.front(), dir_ + "/run7_000000.pt");
  EXPECT_EQ(other.list(), std::vector<std::string>{dir_ + "/checkpoint_000000.pt"});
}

// LoadOptions::map_location: tensors land on the device asked for (CPU by default; the meta
// device stands in for an accelerator: same code path, no data).
TEST_F(CheckpointResume, LoadOptionsMapLocation) {
  TrainingState state;
  state.model.insert("w", torch::arange(6, torch::kFloat).reshape({2, 3}));
  state.step = 3;
  const std::string file = dir_ + "/state.pt";
  save_training_state(state, file);
  const auto on_cpu = load_training_state(file);
  EXPECT_TRUE(on_cpu.model["w"].device().is_cpu());
  EXPECT_TRUE(at::equal(on_cpu.model["w"], state.model["w"]));
  LoadOptions meta;
  meta.map_location = c10::Device(c10::kMeta);
  const auto moved = load_training_state(file, meta);
  EXPECT_EQ(moved.step, 3);
  ASSERT_EQ(moved.model.size(), 1u);
  for (const auto& item : moved.model) {
    EXPECT_TRUE(item.value().device().is_meta()) << item.key() << " on " << item.value().device();
    EXPECT_EQ(item.value().sizes(), state.model[item.key()].sizes()) << item.key();
  }
}

TEST_F(CheckpointResume, KilledWriterLeavesALoadableCheckpoint) {
  // Each checkpoint holds a large tensor filled with its own step, so a torn write would show.
  constexpr int64_t kElements = 4 << 20;  // 16 MiB per file: a save takes long enough to be hit
  std::mt19937 random(12345);  // fixed: the same kill points on every run
  for (int round = 0; round < 3; ++round) {
    const int64_t start = round * 1000;
    shoal::testing::ChildProcess writer([&] {
      CheckpointManager manager(dir_, 2);
      TrainingState state;
      state.model.insert("w", torch::empty({kElements}));
      for (int64_t step = start;; ++step) {
        state.step = step;
        state.model["w"].fill_(static_cast<float>(step));
        manager.save(state);
      }
    });
    const std::string tmp_suffix = ".tmp." + std::to_string(writer.pid());
    // The writer's temporary file, while it is in the middle of a save; "" otherwise.
    const auto file_being_written = [&]() -> std::string {
      for (const auto& entry : std::filesystem::directory_iterator(dir_)) {
        const std::string name = entry.path().filename().string();
        if (name.size() > tmp_suffix.size() &&
            name.compare(name.size() - tmp_suffix.size(), tmp_suffix.size(), tmp_suffix) == 0) {
          return name;
        }
      }
      return "";
    };
    // Wait for this round's first checkpoint; then catch the writer mid-save: wait for its
    // temporary file, a seeded moment more, stop it (SIGSTOP) and kill it only if that file is
    // still there (else the save finished in between: let it go on and try again).
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (true) {
      auto latest = CheckpointManager(dir_, 2).load_latest();
      if (latest && latest->step >= start) break;
      ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "the writer saved nothing";
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    std::string killed_in;
    int attempts = 0;
    while (killed_in.empty()) {
      ASSERT_LT(std::chrono::steady_clock::now(), deadline)
          << "could not stop the writer mid-save in " << attempts << " attempts";
      const std::string name = file_being_written();
      if (name.empty()) {
        std::this_thread::sleep_for(std::chrono::microseconds(200));
        continue;
      }
      ++attempts;
      std::this_thread::sleep_for(
          std::chrono::microseconds(std::uniform_int_distribution<>(0, 20'000)(random)));
      writer.kill(SIGSTOP);
      if (std::filesystem::exists(dir_ + "/" + name)) {
        killed_in = name;
        writer.kill(SIGKILL);
      } else {
        writer.kill(SIGCONT);
      }
    }
    ASSERT_TRUE(writer.wait(shoal::testing::Milliseconds(10'000)));
    EXPECT_EQ(writer.result().signal, SIGKILL);
    // The kill landed mid-save: the half-written file is left behind, and ignored.
    EXPECT_TRUE(std::filesystem::exists(dir_ + "/" + killed_in)) << killed_in;
    std::cout << "round " << round << ": killed mid-save of " << killed_in << " (attempt "
              << attempts << ")\n";

    const auto latest = CheckpointManager(dir_, 2).load_latest();
    ASSERT_TRUE(latest.has_value());
    EXPECT_GE(latest->step, start);
    EXPECT_TRUE(at::equal(latest->model["w"], torch::full({kElements}, static_cast<float>(latest->step))))
        << "checkpoint of step " << latest->step << " is torn";
    for (const auto& path : CheckpointManager(dir_, 2).list()) {
      EXPECT_NO_THROW(load_training_state(path)) << path;
    }
  }
}

TEST_F(CheckpointResume, DistributedSaveWritesOnceAndWaits) {
  constexpr int kWorld = 3;
  auto store = comm::make_hash_store();
  std::vector<std::string> paths(kWorld);
  shoal::testing::run_threads(kWorld, [&](int rank) {
    auto pg = comm::new_process_group("gloo", store, rank, kWorld, comm::Milliseconds(60'000));
    CheckpointManager manager(dir_, 3);
    TrainingState state;
    state.model.insert("w", torch::full({4}, 1.5));
    state.world_size = kWorld;
    paths[rank] = manager.save(state, pg.get());
    // Every rank may read the file as soon as save() returned.
    const auto loaded = load_training_state(paths[rank]);
    EXPECT_TRUE(at::equal(loaded.model["w"], state.model["w"]));
    EXPECT_EQ(loaded.world_size, kWorld);
  });
  EXPECT_EQ(paths[0], dir_ + "/checkpoint_000000.pt");
  EXPECT_EQ(paths[1], paths[0]);
  EXPECT_EQ(paths[2], paths[0]);
  EXPECT_EQ(CheckpointManager(dir_, 3).list().size(), 1u);  // written once

  // When rank 0 cannot write, every rank throws instead of waiting or carrying on.
  const std::string blocked = dir_ + "/not-a-folder";
  std::ofstream(blocked) << "x";
  std::vector<std::string> errors(kWorld);
  auto store2 = comm::make_hash_store();
  shoal::testing::run_threads(kWorld, [&](int rank) {
    auto pg = comm::new_process_group("gloo", store2, rank, kWorld, comm::Milliseconds(60'000));
    CheckpointManager manager(blocked + "/sub", 3);
    TrainingState state;
    state.model.insert("w", torch::zeros({1}));
    try {
      manager.save(state, pg.get());
    } catch (const CheckpointError& e) {
      errors[rank] = e.what();
    }
  });
  EXPECT_NE(errors[0].find("cannot create the checkpoint folder"), std::string::npos) << errors[0];
  for (int rank = 1; rank < kWorld; ++rank) {
    EXPECT_NE(errors[rank].find("rank 0 failed to save the checkpoint"), std::string::npos) << errors[rank];
  }
}

std::string run(const std::string& command) {
  FILE* pipe = ::popen((command + " 2>&1").c_str(), "r");
  std::string text;
  char buffer[4096];
  while (size_t n = std::fread(buffer, 1, sizeof(buffer), pipe)) text.append(buffer, n);
  const int status = ::pclose(pipe);
  return std::to_string(WIFEXITED(status) ? WEXITSTATUS(status) : -1) + "\n" + text;
}

// A 2-rank sharded checkpoint of one unit holding "w" (5 elements, padded to 6): rank `rank`'s
// piece, its values drawn from `seed` (another seed: another run with the same shapes and step).
ShardedTrainingState sharded_piece(int rank, int seed, int64_t step) {
  ShardedTrainingState s;
  s.rank = rank;
  s.world_size = 2;
  s.num_parameters = 1;
  s.state_dict_keys = {"w"};
  FlatUnitMetadata unit;
  unit.param_names = {"w"};
  unit.shapes = {{5}};
  unit.offsets = {0};
  unit.param_indices = {0};
  unit.numel = 5;
  unit.padded = 6;
  s.units = {unit};
  s.flat_param_shards = {torch::full({3}, static_cast<float>(seed * 10 + rank))};
  s.optimizer_shards = {{}};
  s.replicated.step = step;
  s.replicated.world_size = 2;
  return s;
}

// Saves one 2-rank sharded checkpoint into `dir` through CheckpointManager (two threads, gloo).
std::string save_sharded_pair(const std::string& dir, int seed, int64_t step, int keep = 0) {
  auto store = comm::make_hash_store();
  std::vector<std::string> folders(2);
  shoal::testing::run_threads(2, [&](int rank) {
    auto pg = comm::new_process_group("gloo", store, rank, 2, comm::Milliseconds(60'000));
    CheckpointManager manager(dir, keep);
    folders[rank] = manager.save_sharded(sharded_piece(rank, seed, step), pg.get());
  });
  EXPECT_EQ(folders[0], folders[1]);
  return folders[0];
}

std::string shoal_cli() {
  const char* binary_dir = std::getenv("SHOAL_BINARY_DIR");
  return std::string(binary_dir ? binary_dir : "build") + "/apps/shoal/shoal";
}

// Two runs (seeds 1 and 2) saved at the same step: rank 1's file of the other run dropped into
// the folder has the same step, units and shapes, and would resume as half of the weights from
// each run. Every rank's file carries its save's id: the mix is refused, in one line
// naming the file, by the library and by the CLI. Folders of the older layout (rank_N.pt files)
// still load, files without ids (an older Shoal's) too, and `convert_sharded_to_dcp` rewrites
// one as the DCP layout that loads the same.
TEST_F(CheckpointResume, ShardedFolderRefusesARankFileOfAnotherSave) {
  const std::string mine = save_sharded_pair(dir_ + "/a", 1, 40);
  const std::string other = save_sharded_pair(dir_ + "/b", 2, 40);
  const TrainingState whole = load_training_state(mine);
  EXPECT_TRUE(at::equal(whole.model["w"], torch::tensor({10.f, 10.f, 10.f, 11.f, 11.f})));
  EXPECT_TRUE(std::filesystem::exists(mine + "/.metadata"));
  EXPECT_TRUE(std::filesystem::exists(mine + "/" + dcp_shard_file_name(1)));

  std::filesystem::copy_file(other + "/__1_0.distcp", mine + "/__1_0.distcp",
                             std::filesystem::copy_options::overwrite_existing);
  try {
    load_training_state(mine);
    ADD_FAILURE() << "a folder mixing two runs' files loaded";
  } catch (const CheckpointError& e) {
    const std::string message = e.what();
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
    EXPECT_NE(message.find(mine + "/__1_0.distcp"), std::string::npos) << message;
    EXPECT_NE(message.find("mixes two saves"), std::string::npos) << message;
  }
  // Rank 0's file swapped too: every file is the other save's (rank 0's holds the id the others
  // are checked against), and the chunks lie where .metadata says: it loads as that save.
  std::filesystem::copy_file(other + "/__0_0.distcp", mine + "/__0_0.distcp",
                             std::filesystem::copy_options::overwrite_existing);
  EXPECT_TRUE(at::equal(load_training_state(mine).model["w"],
                        torch::tensor({20.f, 20.f, 20.f, 21.f, 21.f})));
  if (std::filesystem::exists(shoal_cli())) {
    const std::string third = save_sharded_pair(dir_ + "/c", 3, 40);
    std::filesystem::copy_file(third + "/__1_0.distcp", mine + "/__1_0.distcp",
                               std::filesystem::copy_options::overwrite_existing);
    const auto start = std::chrono::steady_clock::now();
    const std::string inspect = run(shoal_cli() + " ckpt inspect " + mine);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_EQ(inspect.substr(0, 2), "1\n") << inspect;
    const std::string text = inspect.substr(2);
    EXPECT_EQ(text.rfind("shoal: error: ", 0), 0u) << text;
    EXPECT_EQ(std::count(text.begin(), text.end(), '\n'), 1) << text;
    EXPECT_NE(text.find("__1_0.distcp"), std::string::npos) << text;
    EXPECT_LT(seconds, 30) << "a refusal that takes this long is a hang on a quiet machine";
  }

  // Files of a Shoal before save ids (no id, no manifest) still load, and convert to the DCP
  // layout; one without an id beside files with one is refused.
  const std::string old = dir_ + "/old";
  std::filesystem::create_directories(old);
  for (int rank = 0; rank < 2; ++rank) {
    save_shard(sharded_piece(rank, 4, 40), old + "/" + shard_file_name(rank));
  }
  const at::Tensor want = torch::tensor({40.f, 40.f, 40.f, 41.f, 41.f});
  EXPECT_TRUE(at::equal(load_training_state(old).model["w"], want));
  convert_sharded_to_dcp(old, dir_ + "/old-as-dcp");
  EXPECT_TRUE(is_sharded_dcp_folder(dir_ + "/old-as-dcp"));
  const TrainingState converted = load_training_state(dir_ + "/old-as-dcp");
  EXPECT_TRUE(at::equal(converted.model["w"], want));
  EXPECT_EQ(converted.step, 40);
  EXPECT_EQ(converted.world_size, 2);
  ShardedTrainingState with_id = sharded_piece(1, 4, 40);
  with_id.save_id = 12345;
  save_shard(with_id, old + "/rank_1.pt");
  EXPECT_THROW(load_training_state(old), CheckpointError);
}

// Two saves in a row interrupted (rank 1 killed mid-write: its temporary file left, no manifest)
// with keep 3: the next save removes both broken folders and keeps the three newest complete
// checkpoints, instead of counting the broken ones and deleting whole checkpoints.
TEST_F(CheckpointResume, InterruptedShardedSavesAreRemovedAndNotCounted) {
  for (int i = 0; i < 3; ++i) save_sharded_pair(dir_, i, 10 * (i + 1), 3);
  const std::string last = dir_ + "/checkpoint_000002.sharded";
  for (const char* broken : {"checkpoint_000003.sharded", "checkpoint_000004.sharded"}) {
    const std::string folder = dir_ + "/" + broken;
    std::filesystem::create_directories(folder);
    std::filesystem::copy_file(last + "/__0_0.distcp", folder + "/__0_0.distcp");
    std::ofstream(folder + "/.__1_0.distcp.tmp.999999999") << "half a file";
  }
  std::ofstream(dir_ + "/.latest.tmp.999999999") << "checkpoint_000004.sharded\n";
  EXPECT_EQ(find_latest(dir_).value(), last);
  EXPECT_EQ(CheckpointManager(dir_, 3).load_latest()->step, 30);

  const std::string newest = save_sharded_pair(dir_, 5, 60, 3);
  EXPECT_EQ(newest, dir_ + "/checkpoint_000005.sharded");
  std::vector<std::string> left;
  for (const auto& entry : std::filesystem::directory_iterator(dir_)) {
    left.push_back(entry.path().filename().string());
  }
  std::sort(left.begin(), left.end());
  EXPECT_EQ(left, (std::vector<std::string>{"checkpoint_000001.sharded",
                                            "checkpoint_000002.sharded",
                                            "checkpoint_000005.sharded", "latest"}));
  for (const auto& path : CheckpointManager(dir_, 3).list()) {
    EXPECT_NO_THROW(load_training_state(path)) << path;
  }
  EXPECT_EQ(CheckpointManager(dir_, 3).load_latest()->step, 60);

  // A full save cleans up after an interrupted sharded one too; the complete ones stay.
  std::filesystem::create_directories(dir_ + "/checkpoint_000006.sharded");
  TrainingState state;
  state.model.insert("w", torch::zeros({5}));
  state.step = 70;
  EXPECT_EQ(CheckpointManager(dir_, 3).save(state), dir_ + "/checkpoint_000007.pt");
  EXPECT_FALSE(std::filesystem::exists(dir_ + "/checkpoint_000006.sharded"));
  EXPECT_EQ(CheckpointManager(dir_, 3).list(),
            (std::vector<std::string>{dir_ + "/checkpoint_000002.sharded",
                                      dir_ + "/checkpoint_000005.sharded",
                                      dir_ + "/checkpoint_000007.pt"}));
}

TEST(SamplerState, SkipIsWorldSizeIndependent) {
  SamplerState sampler;
  sampler.samples_seen = 96;  // e.g. 4 ranks x 3 batches of 8
  EXPECT_EQ(samples_to_skip_per_rank(sampler, 4), 24);
  EXPECT_EQ(samples_to_skip_per_rank(sampler, 2), 48);
  EXPECT_EQ(samples_to_skip_per_rank(sampler, 3), 32);
}


TEST_F(CheckpointResume, CliInspectsAndConverts) {
  const char* binary_dir = std::getenv("SHOAL_BINARY_DIR");
  const std::string shoal = std::string(binary_dir ? binary_dir : "build") + "/apps/shoal/shoal";
  SHOAL_SKIP_UNLESS(std::filesystem::exists(shoal), ::shoal::testing::Dependency::kOptional,
                    shoal + " is not built");

  torch::manual_seed(0);
  auto net = make_net();
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  train(net, sgd, 1);
  TrainingState state = capture(*net, &sgd);
  state.epoch = 4;
  state.step = 321;
  state.config["lr"] = 0.1;
  const std::string file = dir_ + "/full.pt";
  save_training_state(state, file);

  const std::string inspect = run(shoal + " ckpt inspect " + file);
  EXPECT_EQ(inspect.substr(0, 2), "0\n") << inspect;
  for (const char* part : {"epoch: 4", "step: 321", "lr = 0.1", "0.weight", "[8, 4]", "float32",
                           "momentum_buffer", "1.num_batches_tracked", "int64"}) {
    EXPECT_NE(inspect.find(part), std::string::npos) << part << " not in:\n" << inspect;
  }

  const std::string out = dir_ + "/model.pt";
  const std::string convert = run(shoal + " ckpt convert " + file + " " + out + " --model-only --add-prefix net.");
  EXPECT_EQ(convert.substr(0, 2), "0\n") << convert;
  const auto converted = load(out).toGenericDict();
  EXPECT_EQ(converted.size(), state.model.size());
  for (const auto& item : state.model) {
    const auto it = converted.find(c10::IValue("net." + item.key()));
    ASSERT_NE(it, converted.end()) << item.key();
    EXPECT_TRUE(at::equal(it->value().toTensor(), item.value())) << item.key();
  }
  const std::string strip = dir_ + "/stripped.pt";
  EXPECT_EQ(run(shoal + " ckpt convert " + out + " " + strip + " --strip-prefix net.").substr(0, 2), "0\n");
  EXPECT_EQ(compare_state_dicts(load_state_dict_file(strip), state.model), "");

  const std::string bad = run(shoal + " ckpt inspect " + dir_ + "/missing.pt");
  EXPECT_EQ(bad.substr(0, 2), "1\n") << bad;
  EXPECT_NE(bad.find("missing.pt"), std::string::npos) << bad;

  // Python reads the converted file (the test is reported skipped without python3-torch).
  SHOAL_REQUIRE_PYTHON_TORCH();
  EXPECT_TRUE(shoal::testing::run_oracle("load_converted " + out + " net."));
}

}  // namespace test_checkpoint_resume
}  // namespace shoal::checkpoint
