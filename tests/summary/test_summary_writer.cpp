// SummaryWriter's files: CRC-32C against its published check value, TFRecord framing read back
// record by record, events from several threads at once, add_scalars' run folders, and the
// one-line errors for what TensorBoard cannot hold. TensorBoard's own reader checks the messages
// in tensorboard_ddp.py.
#include <gtest/gtest.h>
#include <torch/torch.h>

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

}  // namespace test_summary_writer
