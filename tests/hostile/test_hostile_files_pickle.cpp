// Hostile checkpoint files, fed to the shoal CLI as a user would:
//  - pickles whose containers are shared (a DAG, not a cycle): a 1 KB file of lists holding the
//    previous level twice, 40 levels deep, stands for 2^41 values once written out, and made
//    `ckpt inspect` print gigabytes, `ckpt convert` die of bad_alloc and `--resume` swell;
//  - a tensor viewing a one-element storage with stride 0: an 800-byte file converted to 512 MB;
//  - a 16 MB dict key reused by 100,000 dicts: 1.6 TB of hashing while loading.
// Each is refused in one line naming what is wrong and the option that allows it, in seconds and
// under twice the peak resident size of the same command on a small genuine file.
#include <gtest/gtest.h>

#include <ATen/Functions.h>

#include <algorithm>
#include <filesystem>

#include "hostile_files_testing.h"
#include "shoal/checkpoint/serialization.h"
#include "shoal/error.h"
#include "testing/idx_files.h"

namespace shoal::checkpoint {
namespace test_hostile_files_pickle {

namespace fs = std::filesystem;
using namespace shoal::testing::hostile_files;

// Generous: the refusals take well under a second; the old readers ran for minutes.
constexpr double kDeadlineSeconds = 60;

class HostilePickles : public ::testing::Test {
 protected:
  void SetUp() override {
    shoal_ = shoal_cli();
    dir_ = shoal::testing::make_temp_dir("hostile-pickle");
    if (baseline_kb_ == 0) {
      // The same command on a small genuine state dict: the process's own baseline.
      const std::string small = path("small.pt");
      StateDict state;
      state.insert("w", at::randn({4, 4}));
      save_state_dict(state, small);
      const CliRun run = run_cli({shoal_, "ckpt", "inspect", small}, kDeadlineSeconds);
      ASSERT_EQ(run.exit_code, 0) << run.text();
      baseline_kb_ = run.peak_kb;
      std::printf("baseline: shoal ckpt inspect of a 4x4 state dict peaks at %ld KiB\n", baseline_kb_);
    }
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& name) const { return dir_ + "/" + name; }

  /// Runs the CLI on a hostile file: it must exit non-zero by itself (no signal, no deadline),
  /// print every one of `words`, and peak under twice the baseline.
  CliRun expect_refused(const std::vector<std::string>& args, const std::vector<std::string>& words) {
    std::vector<std::string> command = {shoal_};
    command.insert(command.end(), args.begin(), args.end());
    const CliRun run = run_cli(command, kDeadlineSeconds);
    std::string line;
    for (const auto& a : args) line += " " + a;
    EXPECT_FALSE(run.timed_out) << line << ": still running after " << kDeadlineSeconds << " s, "
                                << run.output_bytes << " bytes printed, peak " << run.peak_kb << " KiB";
    EXPECT_EQ(run.signal, 0) << line << ": died of signal " << run.signal << "\n" << run.text();
    EXPECT_GT(run.exit_code, 0) << line << "\n" << run.text();
    for (const auto& word : words) EXPECT_NE(run.text().find(word), std::string::npos) << line << "\n" << run.text();
    EXPECT_LT(run.peak_kb, 2 * baseline_kb_) << line << ": peak resident " << run.peak_kb << " KiB, baseline "
                                             << baseline_kb_ << " KiB";
    EXPECT_LT(run.output_bytes, 64u * 1024) << line;
    std::printf("shoal%s: exit %d in %.2f s, peak %ld KiB (baseline %ld), %llu bytes of output: %s\n",
                line.c_str(), run.exit_code, run.seconds, run.peak_kb, baseline_kb_,
                static_cast<unsigned long long>(run.output_bytes), run.tail.substr(0, 600).c_str());
    return run;
  }

  std::string shoal_;
  std::string dir_;
  static long baseline_kb_;
};

long HostilePickles::baseline_kb_ = 0;

/// Lists level 0..levels: level 0 is [], level i holds level i-1 `width` times (memo ids 1, 2, ...
/// of one byte: levels < 250). The last level is left on the stack.
std::string shared_lists(int levels, int width) {
  std::string out = "]q\x01" "0";  // EMPTY_LIST, BINPUT 1, POP
  for (int i = 1; i <= levels; ++i) {
    out += "](";  // EMPTY_LIST, MARK
    for (int k = 0; k < width; ++k) out += "h" + std::string(1, static_cast<char>(i));  // BINGET i
    out += "eq" + std::string(1, static_cast<char>(i + 1)) + "0";  // APPENDS, BINPUT i+1, POP
  }
  return out + "h" + std::string(1, static_cast<char>(levels + 1));
}

/// {'model': {}, 'config': {'x': lists}} as a checkpoint from Python would hold it (no manifest).
std::string checkpoint_of(const std::string& path, const std::string& lists) {
  const std::string pickle = std::string("\x80\x02}", 3) + text("model") + "}s" + text("config") + "}" +
                             text("x") + lists + "ss.";
  write_archive(path, {{"data.pkl", pickle}, {"byteorder", "little"}});
  return path;
}

TEST_F(HostilePickles, ListsSharedFortyLevelsDeepAreRefusedByInspectConvertAndResume) {
  const std::string file = checkpoint_of(path("dag.pt"), shared_lists(40, 2));
  EXPECT_LT(fs::file_size(file), 4096u);  // the issue's 1.1 KB (the zip adds 0.8 KB to the 442-byte pickle, 1.6 KB under LibTorch 2.x)
  const std::vector<std::string> words = {"dag.pt", "4194304 values", "shares", "--max-values"};
  expect_refused({"ckpt", "inspect", file}, words);
  expect_refused({"ckpt", "convert", file, path("out.pt")}, words);
  EXPECT_FALSE(fs::exists(path("out.pt")));
  // --resume with it as the newest checkpoint: refused before the config is read.
  const std::string ckpt = path("ckpt");
  fs::create_directories(ckpt);
  fs::copy_file(file, ckpt + "/checkpoint_000000.pt");
  const std::string data = shoal::testing::make_small_dataset_dir(64, 32);
  expect_refused({"train", "--model", "mlp", "--data-dir", data, "--epochs", "1", "--batch-size", "32",
                  "--threads", "1", "--no-progress", "--checkpoint-dir", ckpt, "--resume"},
                 {"checkpoint_000000.pt", "4194304 values", "--max-values"});
  fs::remove_all(data);
}

TEST_F(HostilePickles, ManySmallSharedContainersAreRefused) {
  // Three levels of 200 references each: 1.8 KB standing for 8 million lists.
  const std::string file = checkpoint_of(path("wide.pt"), shared_lists(3, 200));
  EXPECT_LT(fs::file_size(file), 4096u);
  const std::vector<std::string> words = {"wide.pt", "4194304 values", "--max-values"};
  expect_refused({"ckpt", "inspect", file}, words);
  expect_refused({"ckpt", "convert", file, path("out.pt")}, words);
}

TEST_F(HostilePickles, SharedContainersWithinTheBudgetLoadAndTheBudgetIsAnOption) {
  // 10 levels: 2047 values written out. Loads (shared lists are legal: torch.save memoizes them)
  // and converts to what Python reads back; a budget below it refuses it.
  const std::string file = checkpoint_of(path("small_dag.pt"), shared_lists(10, 2));
  const c10::IValue object = load(file);
  ASSERT_TRUE(object.isGenericDict());
  const CliRun inspect = run_cli({shoal_, "ckpt", "inspect", file}, kDeadlineSeconds);
  EXPECT_EQ(inspect.exit_code, 0) << inspect.text();
  const CliRun convert = run_cli({shoal_, "ckpt", "convert", file, path("out.pt")}, kDeadlineSeconds);
  EXPECT_EQ(convert.exit_code, 0) << convert.text();
  LoadOptions tight;
  tight.max_values = 1000;
  try {
    load(file, tight);
    ADD_FAILURE() << "a 2047-value object loaded under a budget of 1000";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("more than 1000 values"), std::string::npos) << e.what();
  }
  expect_refused({"ckpt", "inspect", "--max-values", "1000", file}, {"more than 1000 values"});
  // Raised explicitly, the forty-level file is read (not printed: that is what the budget is for).
  LoadOptions raised;
  raised.max_values = UINT64_MAX;
  EXPECT_TRUE(load(checkpoint_of(path("dag.pt"), shared_lists(40, 2)), raised).isGenericDict());
}

TEST_F(HostilePickles, LargeKeyReusedByManyDictsIsRefused) {
  // One 16 MB string, then 100,000 one-entry dicts keyed by it through the memo (7 bytes each):
  // every insertion hashes the 16 MB again, 1.6 TB in all, for a 17 MB file.
  constexpr uint32_t kKeyBytes = 16u << 20;
  std::string pickle = std::string("\x80\x02", 2) + "X" + u32(kKeyBytes) + std::string(kKeyBytes, 'k') + "q\x01" "0";
  for (int i = 0; i < 100000; ++i) pickle += "}h\x01" + small_int(0) + "s0";  // EMPTY_DICT, BINGET, K, SETITEM, POP
  pickle += "}.";
  const std::string file = path("keys.pt");
  write_archive(file, {{"data.pkl", pickle}, {"byteorder", "little"}});
  expect_refused({"ckpt", "inspect", file}, {"keys.pt", "bytes to hash", "a large key reused by many dicts"});
}

/// A list of `count` distinct empty dicts, appended 1000 at a time as Python's pickler batches
/// them (EMPTY_LIST, then MARK, EMPTY_DICT x 1000, APPENDS per batch).
std::string empty_dicts(int count) {
  std::string out = "]";
  for (int done = 0; done < count; done += 1000) {
    out += "(" + std::string(static_cast<size_t>(std::min(1000, count - done)), '}') + "e";
  }
  return out;
}

/// Runs `shoal ckpt inspect` on `file`; prints and returns what it took.
CliRun inspect_run(const std::string& shoal, const std::string& file) {
  const CliRun run = run_cli({shoal, "ckpt", "inspect", file}, kDeadlineSeconds);
  std::printf("shoal ckpt inspect %s: exit %d in %.2f s, peak %ld KiB, %llu bytes of output: %s\n",
              file.c_str(), run.exit_code, run.seconds, run.peak_kb,
              static_cast<unsigned long long>(run.output_bytes), run.tail.substr(0, 600).c_str());
  return run;
}

// Four million empty dicts in one list hold fewer values than --max-values, but each costs a few
// hundred bytes where the file spends one: `ckpt inspect` reached 1.5 GB and ran past 60 s (a
// million: 714 MB and 29 MB of output). The containers' memory is budgeted as the file loads
// (256 MiB by default): refused in one line, the peak within the budget of the baseline.
TEST_F(HostilePickles, MillionsOfEmptyDictsAreRefusedWithinAMemoryBudget) {
  const std::string file = checkpoint_of(path("dicts.pt"), empty_dicts(4'000'000));
  const CliRun run = inspect_run(shoal_, file);
  EXPECT_FALSE(run.timed_out);
  EXPECT_EQ(run.signal, 0);
  EXPECT_EQ(run.exit_code, 1) << run.text();
  EXPECT_LT(run.seconds, 30);
  const std::string text = run.text();
  EXPECT_EQ(text.rfind("shoal: error: ", 0), 0u) << text;
  EXPECT_EQ(std::count(text.begin(), text.end(), '\n'), 1) << text;
  for (const char* word : {"dicts.pt", "bytes of memory", "--max-container-bytes"}) {
    EXPECT_NE(run.text().find(word), std::string::npos) << word << " not in " << run.text();
  }
  const long budget_kb = static_cast<long>(LoadOptions{}.max_container_bytes / 1024);
  EXPECT_LT(run.peak_kb, baseline_kb_ + budget_kb + 64 * 1024)
      << "peak " << run.peak_kb << " KiB, baseline " << baseline_kb_ << " KiB";
  // The limit is an option: below it, a hundred thousand dicts are refused too.
  LoadOptions tight;
  tight.max_container_bytes = 1 << 20;
  EXPECT_THROW(load(checkpoint_of(path("small.pt"), empty_dicts(100'000)), tight), CheckpointError);
}

// Within the budget, a long container prints as its first and last items and "... N more": a
// hundred thousand dicts in a list print a dozen lines, not 3 MB.
TEST_F(HostilePickles, LongContainersPrintElided) {
  const std::string file = checkpoint_of(path("dicts.pt"), empty_dicts(100'000));
  const CliRun run = inspect_run(shoal_, file);
  EXPECT_EQ(run.exit_code, 0) << run.text();
  EXPECT_LT(run.output_bytes, 4096u) << run.text();
  for (const char* line : {"x: list of 100000 items", "[0]: dict of 0 entries",
                           "[4]: dict of 0 entries", "... 99990 more", "[99995]: dict of 0 entries",
                           "[99999]: dict of 0 entries"}) {
    EXPECT_NE(run.text().find(line), std::string::npos) << line << " not in " << run.text();
  }
  EXPECT_EQ(run.text().find("[5]:"), std::string::npos) << run.text();
  EXPECT_LT(run.peak_kb, baseline_kb_ + 128 * 1024)
      << "peak " << run.peak_kb << " KiB, baseline " << baseline_kb_ << " KiB";
}

/// {'model': {'w': a float tensor of `numel` elements viewing a one-element storage, stride 0}}.
std::string expanded_view_file(const std::string& path, int32_t numel) {
  const std::string storage = "(" + text("storage") + global("torch", "FloatStorage") + text("0") + text("cpu") +
                              small_int(1) + "tQ";  // MARK ... TUPLE, BINPERSID
  const std::string tensor = global("torch._utils", "_rebuild_tensor_v2") + "(" + storage + small_int(0) +
                             int32(numel) + "\x85" + small_int(0) + "\x85" + "\x89" +
                             global("collections", "OrderedDict") + ")R" + "tR";
  const std::string pickle = std::string("\x80\x02}", 3) + text("model") + "}" + text("w") + tensor + "ss.";
  const float one = 1.0f;
  write_archive(path, {{"data.pkl", pickle}, {"byteorder", "little"},
                       {"data/0", std::string(reinterpret_cast<const char*>(&one), sizeof(one))}});
  return path;
}

TEST_F(HostilePickles, StrideZeroViewIsBoundedByItsStorage) {
  constexpr int32_t kNumel = 1 << 27;  // 512 MB of float32 from one stored element
  const std::string file = expanded_view_file(path("expand.pt"), kNumel);
  EXPECT_LT(fs::file_size(file), 4096u);  // the issue's 826 bytes
  const std::string out = path("out.pt");
  expect_refused({"ckpt", "convert", file, out},
                 {"expand.pt", "134217728 elements", "storage of only 1", "--allow-expanded-views"});
  EXPECT_FALSE(fs::exists(out));
  // Asked for, the view loads as a view (inspect prints its shape without copying it).
  const CliRun inspect = run_cli({shoal_, "ckpt", "inspect", "--allow-expanded-views", file}, kDeadlineSeconds);
  EXPECT_EQ(inspect.exit_code, 0) << inspect.text();
  EXPECT_NE(inspect.text().find("w: [134217728] float32"), std::string::npos) << inspect.text();
  EXPECT_LT(inspect.peak_kb, 2 * baseline_kb_);
  LoadOptions allow;
  allow.allow_expanded_views = true;
  const auto state = load_state_dict_file(file, allow);
  EXPECT_EQ(state["w"].numel(), kNumel);
  EXPECT_EQ(state["w"].stride(0), 0);
}

}  // namespace test_hostile_files_pickle
}  // namespace shoal::checkpoint
