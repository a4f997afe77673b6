// SummaryWriter's files: CRC-32C against its published check value, TFRecord framing read back
// record by record, events from several threads at once, add_scalars' run folders, and the
// one-line errors for what TensorBoard cannot hold. TensorBoard's own reader checks the messages
// in tensorboard_ddp.py.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "shoal/error.h"
#include "shoal/summary/summary_writer.h"
#include "summary/event_encoding.h"
#include "testing/idx_files.h"
#include "testing/python.h"
#include "testing/shoal_cli.h"

namespace test_summary_writer {

namespace fs = std::filesystem;
using shoal::summary::SummaryWriter;

/// The payloads of the TFRecords in `path`; fails the test on a bad CRC or a truncated record.
std::vector<std::string> read_records(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  const std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::string> records;
  size_t at = 0;
  while (at < data.size()) {
    EXPECT_LE(at + 12, data.size()) << "truncated header at " << at;
    if (at + 12 > data.size()) break;
    uint64_t length = 0;
    uint32_t length_crc = 0;
    std::memcpy(&length, data.data() + at, 8);
    std::memcpy(&length_crc, data.data() + at + 8, 4);
    EXPECT_EQ(length_crc, shoal::summary::masked_crc32c(data.data() + at, 8)) << "at " << at;
    EXPECT_LE(at + 16 + length, data.size()) << "truncated record at " << at;
    if (at + 16 + length > data.size()) break;
    const std::string payload = data.substr(at + 12, length);
    uint32_t data_crc = 0;
    std::memcpy(&data_crc, data.data() + at + 12 + length, 4);
    EXPECT_EQ(data_crc, shoal::summary::masked_crc32c(payload.data(), payload.size()))
        << "at " << at;
    records.push_back(payload);
    at += 16 + length;
  }
  return records;
}

std::vector<std::string> event_files(const std::string& dir) {
  std::vector<std::string> files;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.path().filename().string().rfind("events.out.tfevents.", 0) == 0) {
      files.push_back(entry.path().string());
    }
  }
  return files;
}

TEST(SummaryWriter, Crc32cMatchesItsCheckValue) {
  // The CRC-32C catalogue's check value (iSCSI, RFC 3720) and the TFRecord mask of it.
  EXPECT_EQ(shoal::summary::crc32c("123456789", 9), 0xe3069283u);
  const uint32_t crc = 0xe3069283u;
  EXPECT_EQ(shoal::summary::masked_crc32c("123456789", 9),
            static_cast<uint32_t>(((crc >> 15) | (crc << 17)) + 0xa282ead8u));
  EXPECT_EQ(shoal::summary::crc32c("", 0), 0u);
}

TEST(SummaryWriter, EveryEventFromManyThreadsIsAFramedRecord) {
  const std::string dir = shoal::testing::make_temp_dir("shoal-summary");
  {
    SummaryWriter writer(dir + "/run");
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t) {
      threads.emplace_back([&writer, t] {
        for (int i = 0; i < 250; ++i) writer.add_scalar("loss/" + std::to_string(t), i * 0.5, i);
      });
    }
    for (auto& thread : threads) thread.join();
    writer.add_text("config", "lr 0.05", 0);
    writer.add_histogram("weights", torch::arange(1000, torch::kFloat), 3);
    writer.add_histogram("constant", torch::full({7}, 2.5), 3);  // one bucket
    writer.flush();
    const std::vector<std::string> files = event_files(dir + "/run");
    ASSERT_EQ(files.size(), 1u);
    EXPECT_EQ(files[0], writer.file_name());
    const std::vector<std::string> records = read_records(files[0]);
    ASSERT_EQ(records.size(), 1u + 4 * 250 + 3);  // file_version first
    EXPECT_NE(records[0].find("brain.Event:2"), std::string::npos);
  }
  fs::remove_all(dir);
}

TEST(SummaryWriter, AddScalarsWritesOneRunFolderPerKey) {
  const std::string dir = shoal::testing::make_temp_dir("shoal-summary");
  {
    SummaryWriter writer(dir);
    writer.add_scalars("loss", {{"train", 0.5}, {"test", 0.7}}, 10);
    writer.add_scalars("loss", {{"train", 0.4}, {"test", 0.6}}, 20);
    writer.flush();
    for (const char* run : {"loss_train", "loss_test"}) {
      const std::vector<std::string> files = event_files(dir + "/" + run);
      ASSERT_EQ(files.size(), 1u) << run;
      EXPECT_EQ(read_records(files[0]).size(), 3u) << run;
    }
  }
  fs::remove_all(dir);
}

TEST(SummaryWriter, RefusesWhatTensorBoardCannotHold) {
  const std::string dir = shoal::testing::make_temp_dir("shoal-summary");
  SummaryWriter writer(dir);
  EXPECT_THROW(writer.add_histogram("nan", torch::tensor({1.0, std::nan("")})), shoal::InvalidArgument);
  EXPECT_THROW(writer.add_histogram("empty", torch::empty({0})), shoal::InvalidArgument);
  EXPECT_THROW(writer.add_histogram("bins", torch::ones({3}), 0, 0), shoal::InvalidArgument);
  writer.close();
  EXPECT_THROW(writer.add_scalar("late", 1.0), shoal::Error);
  fs::remove_all(dir);
  // A folder that cannot be made: one line naming it.
  try {
    SummaryWriter bad("/proc/shoal-no-such-dir/run");
    FAIL() << "no error";
  } catch (const shoal::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("/proc/shoal-no-such-dir/run"), std::string::npos)
        << e.what();
  }
}

// A disk that fills mid-write (here a file-size limit, RLIMIT_FSIZE, with SIGXFSZ ignored: the
// write is cut short at the limit, then refused) must not leave the event file ending inside a
// record, which TensorBoard's reader stops at with a data-loss error: the writer cuts the file
// back to its last whole record and says so in one line naming the file.
TEST(SummaryWriter, AFullDiskLeavesOnlyWholeRecords) {
  const std::string dir = shoal::testing::make_temp_dir("shoal-summary-full");
  constexpr rlim_t kLimit = 10007;  // bytes: a prime, so no record boundary falls on it by design
  int pipe_fds[2];
  ASSERT_EQ(::pipe(pipe_fds), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::close(pipe_fds[0]);
    ::signal(SIGXFSZ, SIG_IGN);
    const rlimit limit{kLimit, kLimit};
    ::setrlimit(RLIMIT_FSIZE, &limit);
    std::string message = "no error";
    try {
      shoal::SummaryWriterOptions options;
      options.flush_secs = 1000;  // written at each flush() below, and in 64 KiB pieces
      SummaryWriter writer(dir, options);
      for (int step = 0; step < 100000; ++step) {
        writer.add_scalar("train/loss_of_a_long_tag_name", 1.0 / (step + 1), step);
        if (step % 7 == 0) writer.flush();
      }
    } catch (const std::exception& e) {
      message = e.what();
    }
    ssize_t ignored = ::write(pipe_fds[1], message.data(), message.size());
    (void)ignored;
    ::_exit(0);
  }
  ::close(pipe_fds[1]);
  std::string message;
  char buffer[4096];
  for (ssize_t n; (n = ::read(pipe_fds[0], buffer, sizeof(buffer))) > 0;) message.append(buffer, n);
  ::close(pipe_fds[0]);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;

  const std::vector<std::string> files = event_files(dir);
  ASSERT_EQ(files.size(), 1u);
  EXPECT_NE(message.find("cannot write " + files[0]), std::string::npos) << message;
  EXPECT_NE(message.find("whole records"), std::string::npos) << message;
  EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  const auto size = fs::file_size(files[0]);
  EXPECT_LE(size, kLimit);
  EXPECT_GT(size, kLimit - 200) << "cut back further than its last whole record";
  const std::vector<std::string> records = read_records(files[0]);  // fails on a cut record
  size_t framed = 0;
  for (const auto& r : records) framed += r.size() + 16;
  EXPECT_EQ(framed, size);
  EXPECT_GT(records.size(), 100u);
  fs::remove_all(dir);
}

// `shoal train --tensorboard` on a disk that fills: one line naming the event file, a non-zero
// exit, and an event file of whole records.
TEST(SummaryWriter, TrainOnAFullDiskStopsInOneLineAndKeepsWholeRecords) {
  const std::string shoal = shoal::testing::shoal_cli_with_dataset();
  const std::string dir = shoal::testing::make_temp_dir("shoal-summary-cli");
  // 24 KiB (dash's ulimit -f counts 512-byte blocks; SIGXFSZ ignored: the write fails, EFBIG):
  // histograms of every parameter at every step fill it within the first steps.
  const auto run = shoal::testing::run_command(
      "ulimit -f 48; trap '' XFSZ; exec " + shoal + " train --model mlp --train-samples 640 "
      "--test-samples 64 --batch-size 32 --epochs 1 --threads 1 --no-progress "
      "--histogram-interval 1 --tensorboard " + dir);
  EXPECT_NE(run.exit_code, 0) << run.describe();
  const std::vector<std::string> files = event_files(dir);
  ASSERT_EQ(files.size(), 1u);
  const size_t at = run.err.find("shoal: error: ");
  ASSERT_NE(at, std::string::npos) << run.describe();
  const std::string line = run.err.substr(at, run.err.find('\n', at) - at);
  EXPECT_NE(line.find("cannot write " + files[0]), std::string::npos) << run.err;
  EXPECT_NE(line.find("whole records"), std::string::npos) << run.err;
  EXPECT_EQ(run.err.find(files[0]), at + line.find(files[0])) << "said twice:\n" << run.err;
  const std::vector<std::string> records = read_records(files[0]);
  size_t framed = 0;
  for (const auto& r : records) framed += r.size() + 16;
  EXPECT_EQ(framed, fs::file_size(files[0]));
  EXPECT_GT(fs::file_size(files[0]), 20000u) << "cut back further than its last whole record";
  fs::remove_all(dir);
}

}  // namespace test_summary_writer
