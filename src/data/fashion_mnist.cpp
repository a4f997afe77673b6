#include "shoal/data/fashion_mnist.h"

#include <sys/stat.h>

#include <ATen/ATen.h>

#include <tuple>
#include <utility>

#include "data/idx_file.h"
#include "shoal/error.h"

namespace shoal::data {

std::string FashionMnist::images_path(const std::string& root, bool train) {
  return root + (train ? "/train-images-idx3-ubyte.gz" : "/t10k-images-idx3-ubyte.gz");
}

std::string FashionMnist::labels_path(const std::string& root, bool train) {
  return root + (train ? "/train-labels-idx1-ubyte.gz" : "/t10k-labels-idx1-ubyte.gz");
}

namespace {

/// The pixels [N, 28, 28] uint8 and labels [N] int64 of a split, with every check on the files.
std::pair<at::Tensor, at::Tensor> read_split(const std::string& root, bool train,
                                             double max_decompression_ratio) {
  struct stat info {};
  if (::stat(root.c_str(), &info) != 0 || !S_ISDIR(info.st_mode)) {
    SHOAL_THROW(DataError, root,
                ": Fashion-MNIST directory not found (install Debian's dataset-fashion-mnist, "
                "or point to a directory holding the *-ubyte.gz files)");
  }
  const std::string image_file = FashionMnist::images_path(root, train);
  const std::string label_file = FashionMnist::labels_path(root, train);
  at::Tensor raw = detail::read_idx_images(image_file, FashionMnist::kRows, FashionMnist::kCols,
                                           max_decompression_ratio);
  at::Tensor targets =
      detail::read_idx_labels(label_file, FashionMnist::kNumClasses, max_decompression_ratio);
  if (raw.size(0) != targets.size(0)) {
    SHOAL_THROW(DataError, image_file, ": holds ", raw.size(0), " images but ", label_file,
                " holds ", targets.size(0), " labels; the two files must come from the same split");
  }
  return {std::move(raw), std::move(targets)};
}

}  // namespace

FashionMnist::FashionMnist(const std::string& root, bool train, double max_decompression_ratio)
    : train_(train) {
  at::Tensor raw;
  std::tie(raw, targets_) = read_split(root, train, max_decompression_ratio);
  images_ = normalize(raw);
}

at::Tensor FashionMnist::normalize(const at::Tensor& pixels) {
  // Elementwise in float32, one operation at a time: a pixel's value depends on nothing but its
  // byte, so a batch normalised alone equals the same rows of the whole split normalised at once.
  return pixels.to(at::kFloat).div_(255.0).sub_(kMean).div_(kStd).unsqueeze(1).contiguous();
}

torch::data::Example<> FashionMnist::get(size_t index) {
  SHOAL_CHECK_T(InvalidArgument, index < static_cast<size_t>(images_.size(0)),
                "FashionMnist::get: index ", index, " is out of range for ", images_.size(0),
                " images");
  const auto i = static_cast<int64_t>(index);
  return {images_[i], targets_[i]};
}

c10::optional<size_t> FashionMnist::size() const { return static_cast<size_t>(images_.size(0)); }

FashionMnistBatches::FashionMnistBatches(const std::string& root, bool train,
                                         double max_decompression_ratio) {
  std::tie(pixels_, targets_) = read_split(root, train, max_decompression_ratio);
}

Batch FashionMnistBatches::get_batch(const at::Tensor& indices) const {
  return {FashionMnist::normalize(pixels_.index_select(0, indices)),
          targets_.index_select(0, indices)};
}

}  // namespace shoal::data
