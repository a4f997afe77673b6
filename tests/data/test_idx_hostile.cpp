// Hostile IDX files: a small gzip that inflates to gigabytes and headers that announce more data
// than any dataset holds are refused with a DataError naming the file, after decompressing no
// more than the header announces, in bounded memory (checked in a forked child).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include <torch/torch.h>

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

// A gzip file is inflated whole when it is one member whose trailer states its size truly, and
// streamed otherwise: several members (valid gzip) read the same images, and a trailer whose size
// field lies (a corrupt file) is refused, never read as something else.
TEST(IdxGzip, OneMemberSeveralMembersAndALyingSizeField) {
  TempDir dir;
  const std::vector<uint8_t> contents = shoal::testing::idx_images(300);
  const at::Tensor want =
      torch::from_blob(const_cast<uint8_t*>(contents.data()) + 16, {300, 28, 28}, at::kByte);
  // Where the build found libdeflate, a file of one gzip member is inflated whole (counted); the
  // others below stream through zlib.
  EXPECT_EQ(detail::idx_whole_file_inflation_built(), SHOAL_TEST_LIBDEFLATE_FOUND != 0);
  const uint64_t whole = detail::idx_whole_file_inflation_built() ? 1 : 0;
  const uint64_t inflations = detail::idx_whole_file_inflations();
  const std::string one = dir.path + "/one.gz";
  shoal::testing::write_gzip(one, contents);
  EXPECT_TRUE(at::equal(detail::read_idx_images(one, 28, 28, FashionMnist::kMaxDecompressionRatio),
                        want));
  EXPECT_EQ(detail::idx_whole_file_inflations(), inflations + whole);

  const size_t half = contents.size() / 2;
  shoal::testing::write_gzip(dir.path + "/a.gz", {contents.begin(), contents.begin() + half});
  shoal::testing::write_gzip(dir.path + "/b.gz", {contents.begin() + half, contents.end()});
  const std::string two = dir.path + "/two.gz";
  {
    std::ofstream out(two, std::ios::binary);
    out << file_bytes(dir.path + "/a.gz") << file_bytes(dir.path + "/b.gz");
  }
  EXPECT_TRUE(at::equal(detail::read_idx_images(two, 28, 28, FashionMnist::kMaxDecompressionRatio),
                        want));

  for (const int delta : {-1, +1}) {
    std::string bytes = file_bytes(one);
    bytes[bytes.size() - 4] = static_cast<char>(static_cast<uint8_t>(bytes[bytes.size() - 4]) + delta);
    const std::string lying = dir.path + "/lying" + std::to_string(delta + 1) + ".gz";
    {
      std::ofstream out(lying, std::ios::binary);
      out << bytes;
    }
    EXPECT_THROW(detail::read_idx_images(lying, 28, 28, FashionMnist::kMaxDecompressionRatio),
                 DataError)
        << "a size field off by " << delta;
  }
  EXPECT_EQ(detail::idx_whole_file_inflations(), inflations + whole);  // the rest streamed
}

}  // namespace test_idx_hostile
}  // namespace shoal::data
