// FashionMnist: the real Debian files load with the right counts, shapes, labels and
// normalisation; every kind of damaged file gives a one-line DataError that names the file.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>

#include "shoal/data/fashion_mnist.h"
#include "shoal/error.h"
#include "testing/idx_files.h"
#include "testing/multi_rank.h"

namespace shoal::data {
namespace test_fashion_mnist {

namespace fs = std::filesystem;
using shoal::testing::idx_images;
using shoal::testing::idx_labels;
using shoal::testing::write_gzip;

// Removes the directory when the test ends.
struct TempDir {
  std::string path = shoal::testing::make_temp_dir("shoal-fmnist");
  ~TempDir() { fs::remove_all(path); }
};

// Skips the current test (not the program: the generated-file tests still run) without the data.
#define SHOAL_REQUIRE_REAL_DATA()                                                  \
  SHOAL_SKIP_UNLESS(shoal::testing::have_real_fashion_mnist(),                     \
                    shoal::testing::Dependency::kDataset,                          \
                    "Fashion-MNIST is not installed (apt-get install dataset-fashion-mnist)")

// Runs `load` and returns the DataError's message; fails the test when nothing or something else
// is thrown.
template <typename Fn>
std::string data_error(Fn&& load) {
  try {
    load();
  } catch (const DataError& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a shoal::DataError";
  return {};
}

void expect_names_file(const std::string& message, const std::string& path, const std::string& problem) {
  EXPECT_EQ(message.rfind(path, 0), 0u) << "message should start with the path: " << message;
  EXPECT_NE(message.find(problem), std::string::npos) << "message should say '" << problem << "': " << message;
  EXPECT_EQ(message.find('\n'), std::string::npos) << "message should be one line: " << message;
}

TEST(FashionMnist, RealTrainSplitLoads) {
  SHOAL_REQUIRE_REAL_DATA();
  FashionMnist train(shoal::testing::real_fashion_mnist_dir(), /*train=*/true);
  ASSERT_EQ(train.size().value(), 60000u);
  EXPECT_EQ(train.images().sizes(), (std::vector<int64_t>{60000, 1, 28, 28}));
  EXPECT_EQ(train.images().scalar_type(), torch::kFloat);
  EXPECT_EQ(train.targets().sizes(), (std::vector<int64_t>{60000}));
  EXPECT_EQ(train.targets().scalar_type(), torch::kLong);
  EXPECT_EQ(train.targets().min().item<int64_t>(), 0);
  EXPECT_EQ(train.targets().max().item<int64_t>(), 9);
  // Fashion-MNIST's training split is balanced: 6000 images per class.
  const torch::Tensor counts = torch::bincount(train.targets());
  EXPECT_TRUE(torch::equal(counts, torch::full({10}, 6000, torch::kLong))) << counts;
  // Normalised with the training set's own statistics: mean ~0 and standard deviation ~1.
  EXPECT_NEAR(train.images().mean().item<double>(), 0.0, 0.01);
  EXPECT_NEAR(train.images().std().item<double>(), 1.0, 0.01);
  // Pixels were bytes: (0 - mean) / std and (1 - mean) / std bound every value.
  EXPECT_NEAR(train.images().min().item<double>(), (0 - FashionMnist::kMean) / FashionMnist::kStd, 1e-5);
  EXPECT_NEAR(train.images().max().item<double>(), (1 - FashionMnist::kMean) / FashionMnist::kStd, 1e-5);

  const auto example = train.get(123);
  EXPECT_EQ(example.data.sizes(), (std::vector<int64_t>{1, 28, 28}));
  EXPECT_TRUE(torch::equal(example.data, train.images()[123]));
  EXPECT_EQ(example.target.item<int64_t>(), train.targets()[123].item<int64_t>());
  EXPECT_THROW(train.get(60000), InvalidArgument);
}

// The trainer's dataset keeps bytes and normalises per batch; its batches must equal the
// rows of images() bit for bit (the same weights after training), in any order and batch size.
TEST(FashionMnistBatches, BatchesEqualNormalisedImagesBitForBit) {
  SHOAL_REQUIRE_REAL_DATA();
  const std::string root = shoal::testing::real_fashion_mnist_dir();
  for (const bool train : {true, false}) {
    const FashionMnist whole(root, train);
    const FashionMnistBatches batches(root, train);
    ASSERT_EQ(batches.size(), static_cast<int64_t>(whole.size().value()));
    EXPECT_EQ(batches.pixels().scalar_type(), torch::kByte);
    torch::manual_seed(7);
    const torch::Tensor order = torch::randperm(batches.size(), torch::kLong);
    for (const int64_t batch : {int64_t{1}, int64_t{64}, int64_t{1000}}) {
      for (int64_t begin = 0; begin < std::min<int64_t>(batches.size(), 5 * batch); begin += batch) {
        const torch::Tensor indices = order.slice(0, begin, begin + batch);
        const Batch got = batches.get_batch(indices);
        EXPECT_EQ(got.data.sizes(), (std::vector<int64_t>{batch, 1, 28, 28}));
        EXPECT_TRUE(got.data.is_contiguous());
        EXPECT_TRUE(torch::equal(got.data, whole.images().index_select(0, indices)));
        EXPECT_TRUE(torch::equal(got.target, whole.targets().index_select(0, indices)));
      }
    }
    // Every image at once, too (the whole split as one batch).
    EXPECT_TRUE(torch::equal(batches.get_batch(order).data, whole.images().index_select(0, order)));
  }
}

// normalize is float32 arithmetic, one rounding per operation, for each of the 256 byte values.
TEST(FashionMnistBatches, NormalizeIsFloatArithmeticPerPixel) {
  const torch::Tensor bytes = torch::arange(256, torch::kLong).to(torch::kByte).view({1, 16, 16});
  const torch::Tensor got = FashionMnist::normalize(bytes);
  ASSERT_EQ(got.sizes(), (std::vector<int64_t>{1, 1, 16, 16}));
  const float* value = got.data_ptr<float>();
  for (int x = 0; x < 256; ++x) {
    const volatile float scaled = static_cast<float>(x) / 255.0f;
    const volatile float centred = scaled - static_cast<float>(FashionMnist::kMean);
    const float expected = centred / static_cast<float>(FashionMnist::kStd);
    EXPECT_EQ(value[x], expected) << "byte " << x;
  }
}

TEST(FashionMnistBatches, MissingFileNamesIt) {
  TempDir dir;
  const std::string message = data_error([&] { FashionMnistBatches batches(dir.path, true); });
  expect_names_file(message, FashionMnist::images_path(dir.path, true), "file not found");
}

TEST(FashionMnist, RealTestSplitLoads) {
  SHOAL_REQUIRE_REAL_DATA();
  FashionMnist test(shoal::testing::real_fashion_mnist_dir(), /*train=*/false);
  ASSERT_EQ(test.size().value(), 10000u);
  EXPECT_EQ(test.images().sizes(), (std::vector<int64_t>{10000, 1, 28, 28}));
  EXPECT_TRUE(torch::equal(torch::bincount(test.targets()), torch::full({10}, 1000, torch::kLong)));
}

TEST(FashionMnist, DecodesPixelsAndLabelsExactly) {
  TempDir dir;
  write_gzip(dir.path + "/t10k-images-idx3-ubyte.gz", idx_images(3));
  write_gzip(dir.path + "/t10k-labels-idx1-ubyte.gz", idx_labels(3));
  FashionMnist data(dir.path, /*train=*/false);
  ASSERT_EQ(data.size().value(), 3u);
  for (int64_t i = 0; i < 3; ++i) {
    EXPECT_EQ(data.targets()[i].item<int64_t>(), i % 10);
    for (int64_t k : {0, 1, 100, 783}) {
      const double pixel = static_cast<double>((i * 7 + k) % 256);
      const double expected = (pixel / 255.0 - FashionMnist::kMean) / FashionMnist::kStd;
      EXPECT_NEAR(data.images()[i][0][k / 28][k % 28].item<double>(), expected, 1e-5);
    }
  }
}

TEST(FashionMnist, TruncatedImageDataNamesFileAndSizes) {
  SHOAL_REQUIRE_REAL_DATA();
  TempDir dir;
  const std::string images = dir.path + "/t10k-images-idx3-ubyte.gz";
  // A valid gzip stream of only the first 1000 bytes of the real file.
  write_gzip(images, shoal::testing::read_gzip_prefix(
                         FashionMnist::images_path(shoal::testing::real_fashion_mnist_dir(), false), 1000));
  fs::copy_file(FashionMnist::labels_path(shoal::testing::real_fashion_mnist_dir(), false),
                dir.path + "/t10k-labels-idx1-ubyte.gz");
  const std::string message = data_error([&] { FashionMnist(dir.path, false); });
  expect_names_file(message, images, "truncated");
  EXPECT_NE(message.find("expected 7840016 bytes"), std::string::npos) << message;  // 16 + 10000*784
  EXPECT_NE(message.find("got 1000"), std::string::npos) << message;
}

TEST(FashionMnist, CutGzipStreamNamesFile) {
  SHOAL_REQUIRE_REAL_DATA();
  TempDir dir;
  const std::string labels = dir.path + "/t10k-labels-idx1-ubyte.gz";
  std::vector<uint8_t> compressed = shoal::testing::read_raw(
      FashionMnist::labels_path(shoal::testing::real_fashion_mnist_dir(), false));
  compressed.resize(compressed.size() / 2);
  shoal::testing::write_raw(labels, compressed);
  write_gzip(dir.path + "/t10k-images-idx3-ubyte.gz", idx_images(10000));
  expect_names_file(data_error([&] { FashionMnist(dir.path, false); }), labels, "truncated");
}

TEST(FashionMnist, CorruptGzipNamesFile) {
  TempDir dir;
  const std::string images = dir.path + "/t10k-images-idx3-ubyte.gz";
  // A gzip header followed by bytes that are not a deflate stream.
  std::vector<uint8_t> bytes = {0x1f, 0x8b, 0x08, 0x00, 0, 0, 0, 0, 0x00, 0x03};
  for (int i = 0; i < 64; ++i) bytes.push_back(0xff);
  shoal::testing::write_raw(images, bytes);
  write_gzip(dir.path + "/t10k-labels-idx1-ubyte.gz", idx_labels(4));
  expect_names_file(data_error([&] { FashionMnist(dir.path, false); }), images, "corrupt");
}

TEST(FashionMnist, WrongMagicNumberNamesFile) {
  TempDir dir;
  const std::string images = dir.path + "/t10k-images-idx3-ubyte.gz";
  const std::string labels = dir.path + "/t10k-labels-idx1-ubyte.gz";
  // A label file where the images should be.
  write_gzip(images, idx_labels(4));
  write_gzip(labels, idx_labels(4));
  const std::string message = data_error([&] { FashionMnist(dir.path, false); });
  expect_names_file(message, images, "bad magic number 2049");
  EXPECT_NE(message.find("2051"), std::string::npos) << message;

  write_gzip(images, idx_images(4));
  write_gzip(labels, idx_labels(4, /*magic=*/1234));
  expect_names_file(data_error([&] { FashionMnist(dir.path, false); }), labels, "bad magic number 1234");
}

TEST(FashionMnist, MissingFileNamesIt) {
  TempDir dir;
  write_gzip(dir.path + "/train-images-idx3-ubyte.gz", idx_images(4));
  const std::string labels = dir.path + "/train-labels-idx1-ubyte.gz";
  expect_names_file(data_error([&] { FashionMnist(dir.path, true); }), labels, "not found");
}

TEST(FashionMnist, MissingDirectoryNamesIt) {
  const std::string missing = "/nonexistent/shoal-fashion-mnist";
  expect_names_file(data_error([&] { FashionMnist(missing, true); }), missing, "not found");
}

TEST(FashionMnist, MismatchedCountsNameBothFiles) {
  TempDir dir;
  const std::string images = dir.path + "/t10k-images-idx3-ubyte.gz";
  const std::string labels = dir.path + "/t10k-labels-idx1-ubyte.gz";
  write_gzip(images, idx_images(5));
  write_gzip(labels, idx_labels(4));
  const std::string message = data_error([&] { FashionMnist(dir.path, false); });
  expect_names_file(message, images, "5 images");
  EXPECT_NE(message.find(labels), std::string::npos) << message;
  EXPECT_NE(message.find("4 labels"), std::string::npos) << message;
}

TEST(FashionMnist, WrongDimensionsNameFile) {
  TempDir dir;
  const std::string images = dir.path + "/t10k-images-idx3-ubyte.gz";
  write_gzip(images, idx_images(4, 27, 27));
  write_gzip(dir.path + "/t10k-labels-idx1-ubyte.gz", idx_labels(4));
  expect_names_file(data_error([&] { FashionMnist(dir.path, false); }), images, "27x27");
}

TEST(FashionMnist, ShortLabelDataAndBadLabelsNameFile) {
  TempDir dir;
  const std::string labels = dir.path + "/t10k-labels-idx1-ubyte.gz";
  write_gzip(dir.path + "/t10k-images-idx3-ubyte.gz", idx_images(4));
  std::vector<uint8_t> short_labels = idx_labels(4);
  short_labels.pop_back();
  write_gzip(labels, short_labels);
  expect_names_file(data_error([&] { FashionMnist(dir.path, false); }), labels, "truncated");

  std::vector<uint8_t> bad_label = idx_labels(4);
  bad_label.back() = 12;
  write_gzip(labels, bad_label);
  expect_names_file(data_error([&] { FashionMnist(dir.path, false); }), labels, "label 12");

  std::vector<uint8_t> trailing = idx_labels(4);
  trailing.push_back(1);
  write_gzip(labels, trailing);
  expect_names_file(data_error([&] { FashionMnist(dir.path, false); }), labels, "corrupt");

  write_gzip(labels, {0, 0, 8});
  expect_names_file(data_error([&] { FashionMnist(dir.path, false); }), labels, "header");
}

TEST(FashionMnist, WorksWithLibTorchDataLoader) {
  TempDir dir;
  write_gzip(dir.path + "/t10k-images-idx3-ubyte.gz", idx_images(10));
  write_gzip(dir.path + "/t10k-labels-idx1-ubyte.gz", idx_labels(10));
  auto dataset = FashionMnist(dir.path, false).map(torch::data::transforms::Stack<>());
  auto loader = torch::data::make_data_loader<torch::data::samplers::SequentialSampler>(
      std::move(dataset), torch::data::DataLoaderOptions().batch_size(4));
  int64_t seen = 0;
  for (const auto& batch : *loader) {
    EXPECT_EQ(batch.data.size(1), 1);
    EXPECT_EQ(batch.data.size(0), batch.target.size(0));
    seen += batch.data.size(0);
  }
  EXPECT_EQ(seen, 10);
}

}  // namespace test_fashion_mnist
}  // namespace shoal::data
