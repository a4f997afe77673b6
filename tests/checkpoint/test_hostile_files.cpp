// Hostile checkpoint files, crafted byte by byte: each is refused with a clear CheckpointError,
// in bounded time and memory, never a crash. The readers run in a forked child so that a crash or
// a swelling would be seen, not suffered, by the test.
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "checkpoint_testing.h"
#include "compat/torch_archive.h"
#include "shoal/checkpoint/checkpoint_manager.h"
#include "shoal/checkpoint/serialization.h"
#include "shoal/checkpoint/state_dict.h"
#include "shoal/error.h"
#include "testing/child_process.h"
#include "testing/python.h"

namespace shoal::checkpoint {
namespace test_hostile_files {

using shoal::testing::ChildOutcome;
using shoal::testing::run_in_child;

// Peak memory any refusal below may take beyond the test process's own: the hostile files would
// need 100 MiB or more if read.
constexpr long kMaxGrowthKb = 64 * 1024;

class HostileFiles : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = shoal::testing::temp_dir("ckpt-hostile"); }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string path(const std::string& name) const { return dir_ + "/" + name; }

  /// A torch.save-shaped archive holding `pickle` as data.pkl.
  std::string write_archive(const std::string& name, const std::string& pickle) {
    const std::string file = path(name);
    std::ofstream out(file, std::ios::binary);
    compat::TorchArchiveWriter writer([&out](const void* data, size_t size) {
      out.write(static_cast<const char*>(data), static_cast<std::streamsize>(size));
      return out ? size : 0;
    });
    writer.write("data.pkl", pickle.data(), pickle.size());
    writer.write("byteorder", "little", 6);
    writer.finish();
    out.close();
    return file;
  }

  /// Loads `file` in a child; expects a CheckpointError containing `expected`, quickly and in
  /// bounded memory.
  void expect_refused(const std::string& file, const std::string& expected) {
    const ChildOutcome outcome = run_in_child([&]() -> std::string {
      try {
        load(file);
      } catch (const CheckpointError& e) {
        return e.what();
      }
      return "loaded without an error";
    });
    ASSERT_TRUE(outcome.exited) << file << ": the reader died of signal " << outcome.signal;
    EXPECT_EQ(outcome.exit_code, 0) << outcome.message;
    EXPECT_NE(outcome.message.find(file), std::string::npos) << outcome.message;
    EXPECT_NE(outcome.message.find(expected), std::string::npos) << outcome.message;
    EXPECT_LT(outcome.peak_growth_kb, kMaxGrowthKb) << file;
    EXPECT_LT(outcome.seconds, 20.0) << file;
    std::printf("%s: refused in %.2f s, peak memory +%ld KiB: %s\n", file.c_str(), outcome.seconds,
                outcome.peak_growth_kb, outcome.message.c_str());
  }

  std::string dir_;
};

std::string u32(uint32_t v) { return std::string(reinterpret_cast<const char*>(&v), 4); }

TEST_F(HostileFiles, SelfReferencingListIsRefused) {
  // x = []; x.append(x); torch.save(x): PROTO 2, EMPTY_LIST, BINPUT 0, BINGET 0, APPEND, STOP.
  const std::string pickle = std::string("\x80\x02]q\x00h\x00" "a.", 9);
  const std::string file = write_archive("self.pt", pickle);
  EXPECT_LT(std::filesystem::file_size(file), 1024u);  // the 363-byte file
  expect_refused(file, "contains itself");
}

TEST_F(HostileFiles, TwoListsHoldingEachOtherAreRefused) {
  // a = []; b = []; b.append(a); a.append(b): a cycle through two containers.
  const std::string pickle = std::string("\x80\x02]q\x00]q\x01h\x00" "aa.", 13);
  expect_refused(write_archive("pair.pt", pickle), "cycle");
}

TEST_F(HostileFiles, MillionNestedListsAreRefused) {
  // [[[[...]]]] a million deep, built inside out: refused before it is built (the stack cap) and
  // when built the way picklers nest (each list closed before the next is opened around it).
  constexpr int kDepth = 1000000;
  std::string pickle = "\x80\x02";
  pickle.append(kDepth, ']');
  pickle.append(kDepth - 1, 'a');
  pickle += '.';
  expect_refused(write_archive("nested.pt", pickle), "stack grows beyond");
  // MARK ... LIST, a million deep: every list is made whole before its parent; ( ( ( ... l l l.
  std::string marks = "\x80\x02";
  marks.append(kDepth, '(');
  marks.append(kDepth, 'l');
  marks += '.';
  expect_refused(write_archive("nested_marks.pt", marks), "nested more than");
}

TEST_F(HostileFiles, NestingBuiltThroughTheMemoIsRefused) {
  // 200000 lists, each appended into the previous one after that one was filled: the depth only
  // shows in the whole, so the final (iterative) walk must find it, and the error path must free
  // the chain without recursing down it.
  constexpr uint32_t kCount = 200000;
  std::string pickle = "\x80\x02";
  for (uint32_t i = 0; i < kCount; ++i) pickle += "]r" + u32(i) + "0";  // EMPTY_LIST LONG_BINPUT POP
  for (uint32_t i = 0; i + 1 < kCount; ++i) pickle += "j" + u32(i) + "j" + u32(i + 1) + "a0";
  pickle += "j" + u32(0) + ".";
  expect_refused(write_archive("chain.pt", pickle), "nested more than");
}

TEST_F(HostileFiles, SharedContainersStillLoad) {
  // x = [1]; torch.save([x, x]) shares x (memoized), which is not a cycle.
  const std::string pickle = std::string("\x80\x02](]q\x01K\x01" "ah\x01" "e.", 14);
  const c10::IValue value = load(write_archive("shared.pt", pickle));
  ASSERT_TRUE(value.isList());
  ASSERT_EQ(value.toListRef().size(), 2u);
  EXPECT_EQ(value.toListRef()[0].toListRef()[0].toInt(), 1);
}

TEST_F(HostileFiles, CliInspectRefusesCycleWithoutCrashing) {
  const std::string file = write_archive("self.pt", std::string("\x80\x02]q\x00h\x00" "a.", 9));
  const std::string shoal = std::string(std::getenv("SHOAL_BINARY_DIR")) + "/apps/shoal/shoal";
  const std::string command = shoal + " ckpt inspect " + file + " 2>&1";
  FILE* pipe = ::popen(command.c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::string output;
  char buffer[512];
  while (std::fgets(buffer, sizeof(buffer), pipe)) output += buffer;
  const int status = ::pclose(pipe);
  ASSERT_TRUE(WIFEXITED(status)) << output;
  EXPECT_NE(WEXITSTATUS(status), 0);
  EXPECT_NE(output.find("contains itself"), std::string::npos) << output;
}

class CompressedRecords : public HostileFiles {
 protected:
  void SetUp() override {
    HostileFiles::SetUp();
    // hostile_zip.py needs Python's standard library only.
    if (!std::filesystem::exists("/usr/bin/python3")) GTEST_SKIP() << "/usr/bin/python3 is missing";
  }
  std::string hostile(const std::string& mode) {
    StateDict state;
    state.insert("weight", torch::ones({4, 4}));
    save_state_dict(state, path("good.pt"));
    const std::string out = path(mode + ".pt");
    const std::string script = std::string(std::getenv("SHOAL_SOURCE_DIR")) + "/tests/checkpoint/hostile_zip.py";
    const std::string command = "/usr/bin/python3 " + script + " " + path("good.pt") + " " + out + " " + mode;
    EXPECT_TRUE(shoal::testing::oracle_succeeded(shoal::testing::run_command(command))) << command;
    return out;
  }
};

TEST_F(CompressedRecords, TensorBombIsRefusedBeforeInflating) {
  const std::string file = hostile("tensor-bomb");
  EXPECT_LT(std::filesystem::file_size(file), 1u << 20);  // inflates to 128 MiB
  expect_refused(file, "is compressed");
}

TEST_F(CompressedRecords, PickleBombIsRefusedBeforeInflating) {
  const std::string file = hostile("pickle-bomb");
  EXPECT_LT(std::filesystem::file_size(file), 1u << 20);  // inflates to 100 MiB
  expect_refused(file, "inflates to");
}

TEST_F(HostileFiles, UnreadableChecksumManifestIsAnError) {
  StateDict state;
  state.insert("weight", torch::arange(16, torch::kFloat));
  save_state_dict(state, path("good.pt"));
  std::string bytes;
  {
    std::ifstream in(path("good.pt"), std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  // The manifest is stored uncompressed: "data.pkl <size> <crc>\n...". One byte turns a digit of
  // its first size into a letter.
  const size_t at = bytes.find("data.pkl ");
  ASSERT_NE(at, std::string::npos);
  std::string damaged = bytes;
  damaged[at + 9] = 'x';
  std::ofstream(path("manifest.pt"), std::ios::binary) << damaged;
  expect_refused(path("manifest.pt"), "checksum manifest");

  // With the manifest intact, a damaged tensor byte is caught by its checksum.
  const size_t data = bytes.find(std::string("\x00\x00\x80\x3f", 4));  // 1.0f, the second element
  ASSERT_NE(data, std::string::npos);
  damaged = bytes;
  damaged[data + 3] = 0x40;
  std::ofstream(path("tensor.pt"), std::ios::binary) << damaged;
  expect_refused(path("tensor.pt"), "fails its checksum");
}

TEST_F(HostileFiles, ResumeFallsBackToNewestIntactCheckpoint) {
  CheckpointManager manager(path("run"), /*keep_last=*/0);
  for (int epoch = 1; epoch <= 3; ++epoch) {
    TrainingState state;
    state.epoch = epoch;
    state.model.insert("w", torch::full({2}, static_cast<float>(epoch)));
    manager.save(state);
  }
  const auto files = manager.list();
  ASSERT_EQ(files.size(), 3u);
  std::filesystem::resize_file(files[2], std::filesystem::file_size(files[2]) / 2);  // newest: cut

  auto point = load_latest_intact(manager.directory());
  ASSERT_TRUE(point.has_value());
  EXPECT_EQ(point->path, files[1]);
  EXPECT_EQ(point->state.epoch, 2);
  ASSERT_EQ(point->skipped.size(), 1u);
  EXPECT_NE(point->skipped[0].find(files[2]), std::string::npos) << point->skipped[0];
  EXPECT_NE(point->skipped[0].find("truncated"), std::string::npos) << point->skipped[0];
  EXPECT_EQ(manager.load_latest()->epoch, 2);

  // None intact: one error listing each file and why.
  std::filesystem::resize_file(files[1], 100);
  { std::ofstream(files[0], std::ios::trunc) << "not a checkpoint"; }
  try {
    load_latest_intact(manager.directory());
    ADD_FAILURE() << "no error";
  } catch (const CheckpointError& e) {
    for (const auto& f : files) EXPECT_NE(std::string(e.what()).find(f), std::string::npos) << e.what();
  }
}

}  // namespace test_hostile_files
}  // namespace shoal::checkpoint
