// Silent acceptance: what must not load without a word, and is refused or named.
//  - dtypes: a checkpoint's int8, bool or complex64 tensor copied into a float32 parameter was
//    cast silently (complex to real included). PyTorch's load_state_dict copies with copy_, which
//    casts; Shoal refuses a change of kind (bool/integer/floating/complex) and names a change of
//    width (float64 -> float32) in one warning, then copies as PyTorch does.
//  - checksums: a tensor flipped and its manifest line deleted, or the manifest removed, loaded
//    the flipped tensor and --resume trained on it.
//  - the parameter server: --resume without its shard file re-initialised the server's momentum;
//    a job killed between the server's save and the workers' resumed the two at different steps.
#include <gtest/gtest.h>

#include <ATen/Functions.h>

#include <filesystem>

#include "hostile_files_testing.h"
#include "shoal/checkpoint/checkpoint_manager.h"
#include "shoal/checkpoint/serialization.h"
#include "shoal/checkpoint/state_dict.h"
#include "shoal/error.h"
#include "shoal/models/registry.h"
#include "testing/idx_files.h"

namespace shoal::checkpoint {
namespace test_hostile_files_silent {

namespace fs = std::filesystem;
using namespace shoal::testing::hostile_files;

class SilentAcceptance : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = shoal::testing::make_temp_dir("hostile-silent"); }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& name) const { return dir_ + "/" + name; }
  std::string dir_;
};

bool same(const StateDict& a, const StateDict& b) {
  for (const auto& item : a) {
    if (!item.value().equal(b[item.key()])) return false;
  }
  return true;
}

TEST_F(SilentAcceptance, DtypeKindChangesAreRefusedAndWidthChangesNamed) {
  auto model = shoal::models::create("mlp", 0);
  const StateDict original = state_dict(*model);
  const std::string key = original.begin()->key();
  StateDict before;
  for (const auto& item : original) before.insert(item.key(), item.value().clone());
  for (const auto dtype : {at::kChar, at::kBool, at::kComplexFloat, at::kInt}) {
    StateDict edited;
    for (const auto& item : before) {
      edited.insert(item.key(), item.key() == key ? (item.value() * 3).to(dtype) : item.value());
    }
    try {
      load_state_dict(*model, edited);
      ADD_FAILURE() << dtype_name(dtype) << " loaded into float32 without an error";
    } catch (const CheckpointError& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find("dtype mismatch for " + key), std::string::npos) << message;
      EXPECT_NE(message.find("holds " + dtype_name(dtype) + ", the model float32"), std::string::npos) << message;
      if (dtype == at::kComplexFloat) EXPECT_NE(message.find("imaginary"), std::string::npos) << message;
    }
    EXPECT_TRUE(same(before, state_dict(*model))) << dtype_name(dtype) << ": the model changed on a refusal";
  }
  // float64: copied (as PyTorch does) and named.
  StateDict wide;
  for (const auto& item : before) wide.insert(item.key(), (item.value() * 2).to(at::kDouble));
  ::testing::internal::CaptureStderr();
  const LoadStateDictResult result = load_state_dict(*model, wide);
  const std::string warning = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(result.cast_keys.size(), before.size());
  EXPECT_NE(warning.find("casts " + std::to_string(before.size()) + " tensor(s)"), std::string::npos) << warning;
  EXPECT_NE(warning.find(key + " float64 -> float32"), std::string::npos) << warning;
  EXPECT_TRUE(state_dict(*model)[key].equal((before[key] * 2)));

  // Through the CLI: `shoal train --init-from` a file with an int8 weight is refused, by name.
  StateDict int8;
  for (const auto& item : before) int8.insert(item.key(), item.key() == key ? item.value().to(at::kChar) : item.value());
  save_state_dict(int8, path("int8.pt"));
  // A few samples of Fashion-MNIST's shape (the model is built for the data, so the data is read
  // before the weights are loaded into it).
  StateDict data;
  data.insert("train_x", at::zeros({8, 1, 28, 28}));
  data.insert("train_y", at::zeros({8}, at::kLong));
  data.insert("test_x", at::zeros({8, 1, 28, 28}));
  data.insert("test_y", at::zeros({8}, at::kLong));
  save_state_dict(data, path("data.pt"));
  const CliRun run = run_cli({shoal_cli(), "train", "--model", "mlp", "--init-from", path("int8.pt"), "--epochs", "1",
                              "--no-progress", "--data", path("data.pt")},
                             60);
  EXPECT_GT(run.exit_code, 0) << run.text();
  EXPECT_NE(run.text().find("dtype mismatch for " + key + ": the checkpoint holds int8"), std::string::npos)
      << run.text();
}

/// `file` rewritten with one byte of record `record` flipped and, as `manifest` says, its manifest
/// line deleted ("line") or the whole manifest removed ("none").
void tamper(const std::string& file, const std::string& record, const std::string& manifest) {
  auto records = read_archive(file);
  std::vector<std::pair<std::string, std::string>> out;
  bool found = false;
  for (auto& [name, bytes] : records) {
    if (name == record) {
      bytes[0] = static_cast<char>(bytes[0] ^ 0x40);
      found = true;
    }
    if (name == "shoal_checksum") {
      if (manifest == "none") continue;
      std::string kept;
      size_t start = 0;
      while (start < bytes.size()) {
        const size_t end = bytes.find('\n', start);
        const std::string line = bytes.substr(start, end - start + 1);
        if (line.compare(0, record.size() + 1, record + " ") != 0) kept += line;
        start = end == std::string::npos ? bytes.size() : end + 1;
      }
      ASSERT_NE(kept, bytes) << "no manifest line for " << record;
      bytes = kept;
    }
    out.emplace_back(name, bytes);
  }
  ASSERT_TRUE(found) << file << " has no record " << record;
  write_archive(file, out);
}

TEST_F(SilentAcceptance, TamperedManifestsAreRefused) {
  StateDict state;
  state.insert("a", at::randn({8}));
  state.insert("b", at::randn({8}));
  save_state_dict(state, path("state.pt"));
  tamper(path("state.pt"), "data/0", "line");
  try {
    load_state_dict_file(path("state.pt"));
    ADD_FAILURE() << "a flipped tensor whose manifest line was deleted loaded";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("record 'data/0' is not in the file's checksum manifest"), std::string::npos)
        << e.what();
  }
  // A training checkpoint (it says Shoal wrote it) without its manifest.
  TrainingState training;
  training.model = state;
  training.config["model"] = std::string("mlp");
  save_training_state(training, path("training.pt"));
  tamper(path("training.pt"), "data/0", "none");
  try {
    load_training_state(path("training.pt"));
    ADD_FAILURE() << "a Shoal checkpoint without its manifest loaded";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("has no checksum manifest"), std::string::npos) << e.what();
  }
  // A file from Python has no manifest and no shoal_version: it loads, as torch.load would.
  const std::string plain = std::string("\x80\x02}", 3) + text("x") + small_int(7) + "s.";
  write_archive(path("python.pt"), {{"data.pkl", plain}, {"byteorder", "little"}});
  EXPECT_TRUE(load(path("python.pt")).isGenericDict());
}

TEST_F(SilentAcceptance, ResumeRefusesATamperedCheckpoint) {
  const std::string shoal = shoal_cli();
  const std::string data = shoal::testing::make_small_dataset_dir(64, 32);
  const std::vector<std::string> common = {shoal, "train", "--model", "mlp", "--data-dir", data, "--batch-size", "32",
                                           "--threads", "1", "--no-progress", "--checkpoint-dir", path("ckpt")};
  auto train = [&](const std::vector<std::string>& more) {
    std::vector<std::string> args = common;
    args.insert(args.end(), more.begin(), more.end());
    return run_cli(args, 120);
  };
  const CliRun first = train({"--epochs", "1"});
  ASSERT_EQ(first.exit_code, 0) << first.text();
  const auto latest = find_latest(path("ckpt"));
  ASSERT_TRUE(latest.has_value());
  fs::copy_file(*latest, path("saved.pt"));
  for (const std::string manifest : {"line", "none"}) {
    fs::copy_file(path("saved.pt"), *latest, fs::copy_options::overwrite_existing);
    tamper(*latest, "data/0", manifest);
    const CliRun resumed = train({"--epochs", "2", "--resume"});
    EXPECT_GT(resumed.exit_code, 0) << manifest << "\n" << resumed.text();
    EXPECT_NE(resumed.text().find(manifest == "line" ? "is not in the file's checksum manifest"
                                                     : "has no checksum manifest"),
              std::string::npos)
        << resumed.text();
    EXPECT_EQ(resumed.text().find("resumed from"), std::string::npos) << resumed.text();
  }
  fs::remove_all(data);
}

TEST_F(SilentAcceptance, ParameterServerResumeWithoutItsShardIsRefused) {
  const std::string shoal = shoal_cli();
  const std::string data = shoal::testing::make_small_dataset_dir(200, 50);
  const std::vector<std::string> common = {shoal, "train", "--strategy", "ps", "--workers", "2", "--servers", "1",
                                           "--model", "mlp", "--data-dir", data, "--batch-size", "20",
                                           "--lr", "0.05", "--momentum", "0.9", "--threads", "1", "--no-progress",
                                           "--checkpoint-dir", path("ckpt")};
  auto train = [&](const std::vector<std::string>& more) {
    std::vector<std::string> args = common;
    args.insert(args.end(), more.begin(), more.end());
    return run_cli(args, 120);
  };
  const CliRun first = train({"--epochs", "1"});
  ASSERT_EQ(first.exit_code, 0) << first.text();
  // 200 samples over 2 workers in batches of 20: the workers' checkpoint is of step 5.
  const std::string shard = path("ckpt") + "/ps-server0.step5.pt";
  ASSERT_TRUE(fs::exists(shard));
  fs::copy_file(shard, path("shard.pt"));
  fs::remove(shard);
  const CliRun resumed = train({"--epochs", "2", "--resume"});
  EXPECT_FALSE(resumed.timed_out) << resumed.text();
  EXPECT_GT(resumed.exit_code, 0) << resumed.text();
  EXPECT_NE(resumed.text().find("ps-server0.step5.pt is missing"), std::string::npos)
      << resumed.text();
  EXPECT_NE(resumed.text().find("momentum"), std::string::npos) << resumed.text();
  std::printf("ps --resume without its shard: exit %d in %.2f s\n", resumed.exit_code, resumed.seconds);
  // The shard back, with its values saved as int8: refused by name, not cast.
  StateDict saved = load_state_dict_file(path("shard.pt"));
  StateDict edited;
  std::string changed;
  for (const auto& item : saved) {
    const bool values = changed.empty() && item.key().find('.') == std::string::npos;
    if (values) changed = item.key();
    edited.insert(item.key(), values ? item.value().to(at::kChar) : item.value());
  }
  ASSERT_FALSE(changed.empty());
  save_state_dict(edited, shard);
  const CliRun int8 = train({"--epochs", "2", "--resume"});
  EXPECT_GT(int8.exit_code, 0) << int8.text();
  EXPECT_NE(int8.text().find("shard state: key " + changed + ": the checkpoint holds int8, the model float32"),
            std::string::npos)
      << int8.text();
  fs::remove_all(data);
}

/// The files of `from` whose names start (or not) with "ps-server", copied into `to`.
void copy_files(const std::string& from, const std::string& to, bool servers) {
  fs::create_directories(to);
  for (const auto& entry : fs::directory_iterator(from)) {
    const std::string name = entry.path().filename().string();
    if ((name.rfind("ps-server", 0) == 0) == servers) fs::copy(entry.path(), to + "/" + name);
  }
}

// The servers save their shards whenever the workers save their checkpoint, the servers first.
// A job killed between the two saves of epoch 2 (the server's written, the workers' not) must not
// resume with the workers at epoch 1 and the server at epoch 2. Each server file holds and is
// named by the workers' step, and a resume restores the one of the workers' step: the run ends
// as the uninterrupted one. A file of another step under that name is refused in one line
// naming it.
TEST_F(SilentAcceptance, ParameterServerCheckpointIsTiedToTheWorkersStep) {
  const std::string shoal = shoal_cli();
  const std::string data = shoal::testing::make_small_dataset_dir(200, 50);
  auto train = [&](const std::string& dir, const std::vector<std::string>& more) {
    std::vector<std::string> args = {shoal, "train", "--strategy", "ps", "--workers", "2",
                                     "--servers", "1", "--model", "mlp", "--data-dir", data,
                                     "--batch-size", "20", "--lr", "0.05", "--momentum", "0.9",
                                     "--threads", "1", "--no-progress", "--checkpoint-dir", dir};
    args.insert(args.end(), more.begin(), more.end());
    const CliRun run = run_cli(args, 120);
    EXPECT_FALSE(run.timed_out) << run.text();
    return run;
  };
  const CliRun first = train(path("first"), {"--epochs", "1"});
  ASSERT_EQ(first.exit_code, 0) << first.text();
  const CliRun whole = train(path("whole"), {"--epochs", "2", "--dump-parameters", path("whole")});
  ASSERT_EQ(whole.exit_code, 0) << whole.text();
  // Killed between the saves of epoch 2: the workers' files of epoch 1, the server's of epoch 2.
  copy_files(path("first"), path("killed"), false);
  copy_files(path("whole"), path("killed"), true);
  const CliRun resumed =
      train(path("killed"), {"--epochs", "2", "--resume", "--dump-parameters", path("resumed")});
  ASSERT_EQ(resumed.exit_code, 0) << resumed.text();
  for (int rank = 0; rank < 2; ++rank) {
    const std::string suffix = ".rank" + std::to_string(rank) + ".pt";
    const StateDict expected = load_state_dict_file(path("whole") + suffix);
    const StateDict got = load_state_dict_file(path("resumed") + suffix);
    ASSERT_EQ(expected.size(), got.size());
    for (const auto& item : expected) {
      EXPECT_LE((item.value() - got[item.key()]).abs().max().item<double>(), 1e-6)
          << "worker " << rank << " " << item.key() << ": the resumed run mixed two steps";
    }
  }
  // The server file of step 5 replaced by the one of step 10 (a file copied under another name).
  const std::string step5 = path("first") + "/ps-server0.step5.pt";
  ASSERT_TRUE(fs::exists(step5));
  ASSERT_TRUE(fs::exists(path("whole") + "/ps-server0.step10.pt"));
  fs::copy_file(path("whole") + "/ps-server0.step10.pt", step5,
                fs::copy_options::overwrite_existing);
  const CliRun refused = train(path("first"), {"--epochs", "2", "--resume"});
  EXPECT_GT(refused.exit_code, 0) << refused.text();
  const std::string text = refused.text();
  // The server's error, on its own line or in the launcher's summary of the rank that failed
  // first (a worker's "store closed" line may reach the console before it).
  const size_t at = text.find(step5 + ": holds the shard of step 10, the workers resume from step 5");
  EXPECT_NE(at, std::string::npos) << text;
  const std::string line = at == std::string::npos ? text : text.substr(at, text.find('\n', at) - at);
  std::printf("ps --resume with a server file of another step: exit %d in %.2f s: %s\n",
              refused.exit_code, refused.seconds, line.c_str());
  fs::remove_all(data);
}

}  // namespace test_hostile_files_silent
}  // namespace shoal::checkpoint
