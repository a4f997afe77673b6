// Hostile TorchScript models given to `shoal train --model`: a 1 MB file whose weight record
// inflates to 1 GiB, a parameter declared [2^40] over a storage of 5 elements, a buffer declared
// [2^33] over 7 that forward reads. Each is refused before LibTorch's loader sees it, in one line
// naming the file, with an exit code (not a signal), in bounded time and memory; the same model
// unpatched trains.
#include <gtest/gtest.h>
#include <torch/script.h>
#include <torch/torch.h>

#include <filesystem>

#include "hostile_files_testing.h"
#include "testing/idx_files.h"
#include "testing/python.h"

namespace shoal::models {
namespace test_hostile_files_script {

namespace fs = std::filesystem;
using namespace shoal::testing::hostile_files;

// Peak resident size a refusal may reach: the CLI with LibTorch loaded is ~200 MB; the bomb
// inflated would add 1 GiB.
// Memory a refused file may add over a run that fails before reading anything (LibTorch loaded:
// ~170 MB on 1.13, ~520 MB for 2.x's CUDA build).
constexpr long kMaxExtraPeakKb = 256 * 1024;

constexpr const char* kLinear = R"(
def forward(self, x):
    return x.flatten(1).matmul(self.weight.t()) + self.extra.sum() * self.scale.sum()
)";

/// A linear model with weight [outputs, inputs], a parameter `extra` [5] and a buffer `scale` [7]
/// that forward reads: sizes no other tensor has, so their tuples can be found in data.pkl.
void save_model(const std::string& path, int64_t outputs = 10, int64_t inputs = 784,
                const char* forward = kLinear) {
  torch::jit::Module module("Net");
  module.register_attribute("training", c10::BoolType::get(), true);
  module.register_parameter("weight", torch::zeros({outputs, inputs}).requires_grad_(), false);
  module.register_parameter("extra", torch::zeros({5}).requires_grad_(), false);
  module.register_buffer("scale", torch::ones({7}));
  module.define(forward);
  module.save(path);
}

/// Pickle protocol 2's LONG1 of `value` in 8 bytes, the only width LibTorch's unpickler reads.
std::string long1(uint64_t value) {
  std::string out = "\x8a\x08";
  for (int i = 0; i < 8; ++i) out += static_cast<char>((value >> (8 * i)) & 0xFF);
  return out;
}

/// `source` rewritten with the 1-D size tuple (n,) in data.pkl declared as (declared,).
void write_with_size(const std::string& source, const std::string& path, uint8_t n, uint64_t declared) {
  auto records = read_archive(source);
  bool patched = false;
  for (auto& [name, bytes] : records) {
    if (name != "data.pkl") continue;
    const std::string tuple = std::string("(K") + static_cast<char>(n) + "t";
    const size_t at = bytes.find(tuple);
    ASSERT_NE(at, std::string::npos);
    ASSERT_EQ(bytes.find(tuple, at + 1), std::string::npos);
    bytes.replace(at, tuple.size(), "(" + long1(declared) + "t");
    patched = true;
  }
  ASSERT_TRUE(patched);
  write_archive(path, records);
}

class HostileScript : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = shoal::testing::make_temp_dir("hostile-script");
    data_ = shoal::testing::make_small_dataset_dir(64, 32);
    save_model(dir_ + "/good.pt");
  }
  void TearDown() override {
    fs::remove_all(dir_);
    fs::remove_all(data_);
  }
  CliRun train(const std::string& model) {
    return run_cli({shoal_cli(), "train", "--model", model, "--data-dir", data_, "--epochs", "1",
                    "--batch-size", "16", "--threads", "1", "--no-progress"},
                   120);
  }
  /// The peak memory of a `shoal train` that fails before reading a model (the file is missing).
  long baseline_peak_kb() {
    static const long kb = train(dir_ + "/missing.pt").peak_kb;
    return kb;
  }
  /// One line naming the file and saying `what`, an exit code, in bounds.
  void expect_refused(const std::string& model, const std::string& what) {
    const CliRun run = train(model);
    const std::string out = run.text();
    EXPECT_FALSE(run.timed_out) << out;
    EXPECT_EQ(run.signal, 0) << out;
    EXPECT_NE(run.exit_code, 0) << out;
    EXPECT_EQ(out.rfind("shoal: error: ", 0), 0u) << out;
    EXPECT_EQ(out.find('\n'), out.size() - 1) << out;
    EXPECT_NE(out.find(model), std::string::npos) << out;
    EXPECT_NE(out.find(what), std::string::npos) << out;
    EXPECT_LT(run.peak_kb, baseline_peak_kb() + kMaxExtraPeakKb) << out;
    EXPECT_LT(run.seconds, 30.0) << out;
    std::printf("%s: %.2f s, peak %ld KiB: %s", model.c_str(), run.seconds, run.peak_kb, out.c_str());
  }
  std::string dir_;
  std::string data_;
};

TEST_F(HostileScript, TheGenuineModelTrains) {
  const CliRun run = train(dir_ + "/good.pt");
  EXPECT_EQ(run.exit_code, 0) << run.text();
}

TEST_F(HostileScript, AWeightRecordInflatingToAGigabyteIsRefusedBeforeInflating) {
  // hostile_zip.py needs Python's standard library only.
  if (!fs::exists("/usr/bin/python3")) GTEST_SKIP() << "/usr/bin/python3 is missing";
  const std::string bomb = dir_ + "/bomb.pt";
  const std::string command = "/usr/bin/python3 " + std::string(std::getenv("SHOAL_SOURCE_DIR")) +
                              "/tests/checkpoint/hostile_zip.py " + dir_ + "/good.pt " + bomb + " weight-bomb";
  ASSERT_TRUE(shoal::testing::oracle_succeeded(shoal::testing::run_command(command))) << command;
  EXPECT_LT(fs::file_size(bomb), 1200u * 1024);
  expect_refused(bomb, "is compressed");
}

TEST_F(HostileScript, AParameterLargerThanItsStorageIsRefused) {
  write_with_size(dir_ + "/good.pt", dir_ + "/param.pt", 5, uint64_t{1} << 40);
  expect_refused(dir_ + "/param.pt", "reaches past the end of its storage");
}

TEST_F(HostileScript, ABufferLargerThanItsStorageIsRefused) {
  write_with_size(dir_ + "/good.pt", dir_ + "/buffer.pt", 7, uint64_t{1} << 33);
  expect_refused(dir_ + "/buffer.pt", "reaches past the end of its storage");
}

// A forward that throws (here only in training mode, so past the first-batch check): one line
// naming the file, the operation and the error; the whole traceback only at debug level.
TEST_F(HostileScript, AForwardThatThrowsIsOneLine) {
  const std::string model = dir_ + "/throws.pt";
  save_model(model, 10, 784, R"(
def forward(self, x):
    y = x.flatten(1)
    if self.training:
        y = y.view(-1, 5)
    return y.matmul(self.weight.t())
)");
  const CliRun run = train(model);
  const std::string out = run.text();
  EXPECT_EQ(run.signal, 0) << out;
  EXPECT_NE(run.exit_code, 0) << out;
  EXPECT_EQ(out.rfind("shoal: error: ", 0), 0u) << out;
  EXPECT_EQ(out.find('\n'), out.size() - 1) << out;
  for (const std::string word : {model, std::string("at `y = y.view(-1, 5)`"), std::string("is invalid for input of size"),
                                 std::string("SHOAL_LOG_LEVEL=debug")}) {
    EXPECT_NE(out.find(word), std::string::npos) << word << " in " << out;
  }
  ::setenv("SHOAL_LOG_LEVEL", "debug", 1);
  const CliRun debug = train(model);
  ::unsetenv("SHOAL_LOG_LEVEL");
  EXPECT_NE(debug.text().find("Traceback of TorchScript"), std::string::npos) << debug.text();
}

// A model that does not fit the data: checked on the first batch, one line with both shapes.
TEST_F(HostileScript, AModelThatDoesNotFitTheDataSaysWhichShapes) {
  const std::string narrow = dir_ + "/narrow.pt";  // takes 100 features; the images have 784
  save_model(narrow, 10, 100);
  CliRun run = train(narrow);
  std::string out = run.text();
  EXPECT_NE(run.exit_code, 0) << out;
  EXPECT_EQ(out.find('\n'), out.size() - 1) << out;
  for (const std::string word : {narrow, "on the first batch of " + data_, std::string("inputs [16, 1, 28, 28]"),
                                 std::string("targets [16]"), std::string("16x784 and 100x10")}) {
    EXPECT_NE(out.find(word), std::string::npos) << word << " in " << out;
  }
  const std::string few = dir_ + "/few.pt";  // 5 logits; the labels go up to 9
  save_model(few, 5, 784);
  run = train(few);
  out = run.text();
  EXPECT_NE(run.exit_code, 0) << out;
  EXPECT_EQ(out.find('\n'), out.size() - 1) << out;
  for (const std::string word : {few + " returns [16, 5] for inputs [16, 1, 28, 28]", std::string("labels up to 9"),
                                 std::string("logits [batch, classes]")}) {
    EXPECT_NE(out.find(word), std::string::npos) << word << " in " << out;
  }
}

}  // namespace test_hostile_files_script
}  // namespace shoal::models
