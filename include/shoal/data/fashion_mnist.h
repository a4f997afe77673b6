// Fashion-MNIST from the gzipped IDX files of Debian's `dataset-fashion-mnist` package.
//
// The whole split is decoded once, in the constructor, into two tensors: images() [N,1,28,28]
// float, normalised with the training set's mean and standard deviation, and targets() [N] int64.
// A trainer slices batches out of those tensors directly (index_select on a shuffled index
// tensor), which is far cheaper than stacking N single-sample get() results; get() is there so the
// dataset also plugs into LibTorch's data API (map, Stack, make_data_loader).
//
// Every problem with the files (missing, truncated, corrupt, wrong magic number, counts or
// dimensions that disagree) throws shoal::DataError with a one-line message that starts with the
// file's path.
//
// FashionMnistBatches is the same split as a BatchDataset for the trainer: it keeps the pixels as
// decoded, one byte each (47 MB for the training split instead of 188 MB of floats), and normalises
// each batch as it is asked for, with the same operations as images(), so its batches are equal bit
// for bit to index_select on images(). Start-up pays for the decoding only.
//
// Thread safety: immutable after construction; const methods may be called from any thread.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/data/datasets/base.h>
#include <torch/data/example.h>

#include <cstddef>
#include <string>

#include "shoal/data/batch_dataset.h"

namespace shoal::data {

/// The Fashion-MNIST training (60000 images) or test (10000 images) split.
class FashionMnist : public torch::data::datasets::Dataset<FashionMnist> {
 public:
  /// Where Debian's `dataset-fashion-mnist` package installs the files.
  static constexpr const char* kDefaultRoot = "/usr/share/datasets/fashion-mnist";
  /// Mean and standard deviation of the training images scaled to [0, 1] (the values the PyTorch
  /// examples use), so that inputs are roughly zero-mean, unit-variance.
  static constexpr double kMean = 0.2860;
  static constexpr double kStd = 0.3530;
  static constexpr int64_t kRows = 28;
  static constexpr int64_t kCols = 28;
  static constexpr int64_t kNumClasses = 10;

  /// Most a file may decode to, as a multiple of its own size, beyond 64 MiB: real image files
  /// decode to 2-5x their gzipped size (Fashion-MNIST 1.8x, MNIST 4.8x), while a 1 MB gzip of
  /// zeros decodes to 1 GB (4 GB as float images, per process). 64 leaves room for sparse images.
  static constexpr double kMaxDecompressionRatio = 64.0;

  /// Reads `<root>/train-*-ubyte.gz` when `train`, else `<root>/t10k-*-ubyte.gz`.
  /// Throws shoal::DataError naming the file when one is missing, truncated or corrupt, or decodes
  /// to more than `max_decompression_ratio` times its size (0: unchecked; see above).
  explicit FashionMnist(const std::string& root = kDefaultRoot, bool train = true,
                        double max_decompression_ratio = kMaxDecompressionRatio);

  /// One normalised image [1,28,28] and its label (a 0-dim int64 tensor).
  torch::data::Example<> get(size_t index) override;
  /// The number of images.
  c10::optional<size_t> size() const override;

  /// All images, [N,1,28,28] float32, normalised as ((x / 255) - kMean) / kStd.
  const at::Tensor& images() const { return images_; }
  /// All labels, [N] int64 in [0, 10).
  const at::Tensor& targets() const { return targets_; }
  /// True for the training split.
  bool is_train() const { return train_; }

  /// The image file of a split under `root`, e.g. "<root>/train-images-idx3-ubyte.gz".
  static std::string images_path(const std::string& root, bool train);
  /// The label file of a split under `root`.
  static std::string labels_path(const std::string& root, bool train);

  /// Pixels as decoded (uint8 [N, 28, 28]) to normalised floats [N, 1, 28, 28]:
  /// ((x / 255) - kMean) / kStd in float32, the one definition images() and FashionMnistBatches use.
  static at::Tensor normalize(const at::Tensor& pixels);

 private:
  at::Tensor images_;
  at::Tensor targets_;
  bool train_;
};

/// The Fashion-MNIST split of FashionMnist as a BatchDataset that stores the pixels as bytes and
/// normalises per batch (FashionMnist::normalize): the batches equal those of a TensorDataset of
/// FashionMnist's images() and targets(), for a quarter of the memory and no normalising pass at
/// start-up.
class FashionMnistBatches : public BatchDataset {
 public:
  /// Reads the split as FashionMnist does, with the same checks and errors.
  explicit FashionMnistBatches(const std::string& root = FashionMnist::kDefaultRoot,
                               bool train = true,
                               double max_decompression_ratio = FashionMnist::kMaxDecompressionRatio);
  int64_t size() const override { return pixels_.size(0); }
  /// Images [k, 1, 28, 28] float32 (normalised) and labels [k] int64.
  Batch get_batch(const at::Tensor& indices) const override;
  /// The pixels as decoded, uint8 [N, 28, 28].
  const at::Tensor& pixels() const { return pixels_; }
  /// All labels, [N] int64 in [0, 10).
  const at::Tensor& targets() const { return targets_; }

 private:
  at::Tensor pixels_;
  at::Tensor targets_;
};

}  // namespace shoal::data
