#include "shoal/data/fashion_mnist.h"

#include <sys/stat.h>

#include "data/idx_file.h"
#include "shoal/error.h"

namespace shoal::data {

std::string FashionMnist::images_path(const std::string& root, bool train) {
  return root + (train ? "/train-images-idx3-ubyte.gz" : "/t10k-images-idx3-ubyte.gz");
}

std::string FashionMnist::labels_path(const std::string& root, bool train) {
  return root + (train ? "/train-labels-idx1-ubyte.gz" : "/t10k-labels-idx1-ubyte.gz");
}

FashionMnist::FashionMnist(const std::string& root, bool train, double max_decompression_ratio)
    : train_(train) {
  struct stat info {};
  if (::stat(root.c_str(), &info) != 0 || !S_ISDIR(info.st_mode)) {
    SHOAL_THROW(DataError, root,
                ": Fashion-MNIST directory not found (install Debian's dataset-fashion-mnist, "
                "or point to a directory holding the *-ubyte.gz files)");
  }
  const std::string image_file = images_path(root, train);
  const std::string label_file = labels_path(root, train);
  const at::Tensor raw = detail::read_idx_images(image_file, kRows, kCols, max_decompression_ratio);
  targets_ = detail::read_idx_labels(label_file, kNumClasses, max_decompression_ratio);
  if (raw.size(0) != targets_.size(0)) {
    SHOAL_THROW(DataError, image_file, ": holds ", raw.size(0), " images but ", label_file,
                " holds ", targets_.size(0), " labels; the two files must come from the same split");
  }
  images_ = raw.to(at::kFloat)
                .div_(255.0)
                .sub_(kMean)
                .div_(kStd)
                .unsqueeze(1)
                .contiguous();
}

torch::data::Example<> FashionMnist::get(size_t index) {
  SHOAL_CHECK_T(InvalidArgument, index < static_cast<size_t>(images_.size(0)),
                "FashionMnist::get: index ", index, " is out of range for ", images_.size(0),
                " images");
  const auto i = static_cast<int64_t>(index);
  return {images_[i], targets_[i]};
}

c10::optional<size_t> FashionMnist::size() const { return static_cast<size_t>(images_.size(0)); }

}  // namespace shoal::data
