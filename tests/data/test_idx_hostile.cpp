// Hostile IDX files: a small gzip that inflates to gigabytes and headers that announce more data
// than any dataset holds are refused with a DataError naming the file, after decompressing no
// more than the header announces, in bounded memory (checked in a forked child).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "data/idx_file.h"
#include "shoal/error.h"
#include "testing/child_process.h"
#include "testing/idx_files.h"

namespace shoal::data {
namespace test_idx_hostile {

namespace fs = std::filesystem;
using shoal::testing::run_in_child;

struct TempDir {
  std::string path = shoal::testing::make_temp_dir("shoal-idx-hostile");
  ~TempDir() { fs::remove_all(path); }
};

std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

/// Expects reading `path` as images (in a child) to fail with a DataError naming the file and
/// saying `problem`, within `max_kb` of extra memory.
void expect_refused(const std::string& path, const std::string& problem, long max_kb) {
  const auto outcome = run_in_child([&]() -> std::string {
    try {
      detail::read_idx_images(path, 28, 28, FashionMnist::kMaxDecompressionRatio);
    } catch (const DataError& e) {
      return e.what();
    }
    return "read without an error";
  });
  ASSERT_TRUE(outcome.exited) << "the reader died of signal " << outcome.signal;
  EXPECT_EQ(outcome.message.rfind(path, 0), 0u) << outcome.message;
  EXPECT_NE(outcome.message.find(problem), std::string::npos) << outcome.message;
  EXPECT_LT(outcome.peak_growth_kb, max_kb) << outcome.message;
  EXPECT_LT(outcome.seconds, 10.0);
  std::printf("refused in %.2f s, peak memory +%ld KiB: %s\n", outcome.seconds, outcome.peak_growth_kb,
              outcome.message.c_str());
}

TEST(IdxHostile, GzipBombIsRefusedWithoutInflatingIt) {
  TempDir dir;
  // gzip members may be concatenated: one 64 MiB member of zeros, repeated 32 times, is a ~2 MB
  // file that inflates to 2 GiB after a valid header announcing 10 images.
  shoal::testing::write_gzip(dir.path + "/zeros.gz", std::vector<uint8_t>(64u << 20, 0));
  const std::string zeros = file_bytes(dir.path + "/zeros.gz");
  shoal::testing::write_gzip(dir.path + "/head.gz", shoal::testing::idx_images(10));
  const std::string bomb = dir.path + "/train-images-idx3-ubyte.gz";
  {
    std::ofstream out(bomb, std::ios::binary);
    out << file_bytes(dir.path + "/head.gz");
    for (int i = 0; i < 32; ++i) out << zeros;
  }
  EXPECT_LT(fs::file_size(bomb), 12u << 20);
  // The header's 7840 bytes and one more are all that may be inflated.
  expect_refused(bomb, "more bytes after the end of the 10 images", 16 * 1024);

  // The same 10 images without the bomb still load.
  const at::Tensor images = detail::read_idx_images(dir.path + "/head.gz", 28, 28, FashionMnist::kMaxDecompressionRatio);
  EXPECT_EQ(images.size(0), 10);
}

TEST(IdxHostile, HeaderAnnouncingTooMuchIsRefusedBeforeAllocating) {
  TempDir dir;
  const std::string path = dir.path + "/huge.gz";
  // 4e9 images of 28x28: 3 TB announced by a 30-byte file.
  std::vector<uint8_t> header = shoal::testing::idx_images(0, 28, 28);
  header[4] = header[5] = header[6] = header[7] = 0xEE;
  shoal::testing::write_gzip(path, header);
  expect_refused(path, "announces more than", 16 * 1024);
}

}  // namespace test_idx_hostile
}  // namespace shoal::data
