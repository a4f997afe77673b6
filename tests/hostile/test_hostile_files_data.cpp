// Hostile data files: an IDX image file just under the 2^30-element cap is a 1 MB
// gzip of zeros that decoded to 1 GB (and 4 GB of float images) per process. A file announcing
// far more than its own size is refused before anything is allocated, in the library and through
// `shoal train`, unless --max-decompression-ratio allows it.
#include <gtest/gtest.h>
#include <zlib.h>

#include <sys/stat.h>

#include <filesystem>
#include <fstream>

#include "data/idx_file.h"
#include "hostile_files_testing.h"
#include "shoal/data/fashion_mnist.h"
#include "shoal/error.h"
#include "testing/child_process.h"
#include "testing/idx_files.h"

namespace shoal::data {
namespace test_hostile_files_data {

namespace fs = std::filesystem;
using namespace shoal::testing::hostile_files;
using shoal::testing::run_in_child;

/// An IDX image file of `count` all-zero 28x28 images, gzipped at level 9 as a bomb would be,
/// written a megabyte at a time (the test never holds the decoded bytes).
void write_zero_images(const std::string& path, uint32_t count) {
  gzFile file = gzopen(path.c_str(), "wb9");
  ASSERT_NE(file, nullptr);
  std::vector<uint8_t> header;
  shoal::testing::append_be32(header, detail::kIdxImagesMagic);
  for (uint32_t d : {count, 28u, 28u}) shoal::testing::append_be32(header, d);
  gzwrite(file, header.data(), static_cast<unsigned>(header.size()));
  const std::vector<uint8_t> zeros(1 << 20, 0);
  uint64_t left = uint64_t{count} * 28 * 28;
  while (left > 0) {
    const auto n = static_cast<unsigned>(std::min<uint64_t>(left, zeros.size()));
    ASSERT_EQ(gzwrite(file, zeros.data(), n), static_cast<int>(n));
    left -= n;
  }
  ASSERT_EQ(gzclose(file), Z_OK);
}

class HostileData : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = shoal::testing::make_temp_dir("hostile-data"); }
  void TearDown() override { fs::remove_all(dir_); }
  std::string dir_;
};

TEST_F(HostileData, IdxJustUnderTheElementCapIsRefusedBeforeAllocating) {
  // 1,369,568 images of 784 bytes: 1,073,741,328 decoded bytes, just under 2^30, from ~1 MB.
  constexpr uint32_t kImages = (uint32_t{1} << 30) / 784;
  write_zero_images(dir_ + "/train-images-idx3-ubyte.gz", kImages);
  shoal::testing::write_gzip(dir_ + "/train-labels-idx1-ubyte.gz", shoal::testing::idx_labels(kImages));
  const auto file_bytes = fs::file_size(dir_ + "/train-images-idx3-ubyte.gz");
  EXPECT_LT(file_bytes, 1200u * 1024);  // the 1.04 MB
  const long baseline_kb = shoal::testing::resident_kb();
  const auto outcome = run_in_child([&]() -> std::string {
    try {
      FashionMnist data(dir_, /*train=*/true);
      return "loaded " + std::to_string(data.images().size(0)) + " images";
    } catch (const DataError& e) {
      return e.what();
    }
  });
  ASSERT_TRUE(outcome.exited) << "the reader died of signal " << outcome.signal;
  for (const char* word : {"train-images-idx3-ubyte.gz", "1073741328 bytes", "decompression bomb",
                           "--max-decompression-ratio"}) {
    EXPECT_NE(outcome.message.find(word), std::string::npos) << outcome.message;
  }
  // Under twice the process's own resident size: the peak growth is below the baseline itself.
  EXPECT_LT(outcome.peak_growth_kb, baseline_kb) << outcome.message;
  EXPECT_LT(outcome.seconds, 30.0);
  std::printf("FashionMnist on a %llu-byte gzip announcing 2^30 bytes: %.2f s, peak +%ld KiB over %ld KiB: %s\n",
              static_cast<unsigned long long>(file_bytes), outcome.seconds, outcome.peak_growth_kb, baseline_kb,
              outcome.message.c_str());

  // Through `shoal train`, against the same command on a small genuine dataset.
  const std::string shoal = shoal_cli();
  const std::string small = shoal::testing::make_small_dataset_dir(64, 32);
  auto train = [&](const std::string& data) {
    return run_cli({shoal, "train", "--model", "mlp", "--data-dir", data, "--epochs", "1", "--batch-size", "32",
                    "--threads", "1", "--no-progress"},
                   120);
  };
  const CliRun baseline = train(small);
  fs::remove_all(small);
  ASSERT_EQ(baseline.exit_code, 0) << baseline.text();
  const CliRun bomb = train(dir_);
  EXPECT_FALSE(bomb.timed_out);
  EXPECT_EQ(bomb.signal, 0) << bomb.text();
  EXPECT_GT(bomb.exit_code, 0) << bomb.text();
  EXPECT_NE(bomb.text().find("decompression bomb"), std::string::npos) << bomb.text();
  EXPECT_LT(bomb.peak_kb, 2 * baseline.peak_kb) << bomb.text();
  std::printf("shoal train on it: exit %d in %.2f s, peak %ld KiB (on a small dataset: %ld KiB)\n", bomb.exit_code,
              bomb.seconds, bomb.peak_kb, baseline.peak_kb);
}

TEST_F(HostileData, TheRatioIsAnExplicitOption) {
  // 100,000 zero images: 78 MB decoded from ~76 KB, beyond the 64 MiB that is always accepted.
  const std::string path = dir_ + "/images.gz";
  write_zero_images(path, 100000);
  EXPECT_THROW(detail::read_idx_images(path, 28, 28, FashionMnist::kMaxDecompressionRatio), DataError);
  const auto loaded = run_in_child([&]() -> std::string {
    const at::Tensor none = detail::read_idx_images(path, 28, 28, /*max_decompression_ratio=*/0);
    const at::Tensor high = detail::read_idx_images(path, 28, 28, /*max_decompression_ratio=*/2000);
    return std::to_string(none.size(0)) + " " + std::to_string(high.size(0));
  });
  EXPECT_EQ(loaded.message, "100000 100000");
  // Below 64 MiB nothing is asked: small test files of uniform pixels compress far better than
  // real images.
  write_zero_images(path, 1000);
  EXPECT_EQ(detail::read_idx_images(path, 28, 28, FashionMnist::kMaxDecompressionRatio).size(0), 1000);
}

// A FIFO where a data file should be: open() would wait for a writer for ever. Each reader refuses
// it before opening, in one line naming it, whichever option brought it.
TEST_F(HostileData, AFifoForADataFileIsRefusedWithoutOpeningIt) {
  const std::string shoal = shoal_cli();
  auto fifo = [](const std::string& path) {
    fs::remove(path);
    ASSERT_EQ(::mkfifo(path.c_str(), 0600), 0) << path;
  };
  auto expect_refused = [&](const std::string& what, const std::string& path, std::vector<std::string> args) {
    args.insert(args.begin(), {shoal, "train"});
    for (const char* flag : {"--epochs", "1", "--threads", "1", "--no-progress"}) args.push_back(flag);
    const CliRun run = run_cli(args, 20);
    const std::string out = run.text();
    EXPECT_FALSE(run.timed_out) << what << ": " << out;
    EXPECT_GT(run.exit_code, 0) << what << ": " << out;
    EXPECT_EQ(out.rfind("shoal: error: ", 0), 0u) << what << ": " << out;
    EXPECT_EQ(out.find('\n'), out.size() - 1) << what << ": " << out;
    EXPECT_NE(out.find(path + ": is a FIFO"), std::string::npos) << what << ": " << out;
    EXPECT_LT(run.seconds, 10.0) << what << ": " << out;
  };
  // CIFAR-10: a genuine training file of 10 records, the test file a FIFO.
  const std::string cifar = dir_ + "/cifar";
  fs::create_directories(cifar);
  std::ofstream(cifar + "/data_batch_1.bin", std::ios::binary) << std::string(10 * 3073, '\1');
  fifo(cifar + "/test_batch.bin");
  expect_refused("CIFAR-10", cifar + "/test_batch.bin", {"--model", "mlp", "--data-dir", cifar});
  // Fashion-MNIST's IDX files: the test labels a FIFO.
  const std::string idx = shoal::testing::make_small_dataset_dir(64, 32);
  fifo(idx + "/t10k-labels-idx1-ubyte.gz");
  expect_refused("IDX", idx + "/t10k-labels-idx1-ubyte.gz", {"--model", "mlp", "--data-dir", idx});
  fs::remove_all(idx);
  // A tensor file (--data) and a TorchScript model (--model).
  fifo(dir_ + "/tensors.pt");
  expect_refused("--data", dir_ + "/tensors.pt", {"--model", "mlp", "--data", dir_ + "/tensors.pt"});
  fifo(dir_ + "/model.pt");
  expect_refused("--model", dir_ + "/model.pt", {"--model", dir_ + "/model.pt", "--data-dir", cifar});
}

}  // namespace test_hostile_files_data
}  // namespace shoal::data
