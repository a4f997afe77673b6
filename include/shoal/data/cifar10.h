// CIFAR-10 in its binary format ("CIFAR-10 binary version" of the dataset's site): the training
// split is data_batch_1.bin, data_batch_2.bin, ... (five files of 10000 records in the release; any
// count here, numbered from 1 without gaps), the test split test_batch.bin. A record is 3073 bytes:
// the label (0-9), then the 32x32 image's red, green and blue planes, row by row.
//
// The images are read lazily: the constructor checks every file (size a whole number of records,
// every label in range) and keeps the labels (one byte each); get_batch() reads the batch's records
// from the files (pread, safe from several threads) and normalises them. With in_memory, the
// constructor reads all the images once instead (3 KB a sample) and get_batch() copies from memory;
// both give bit-identical batches. Inputs are [B, 3, 32, 32] float32, ((x / 255) - mean) / std per
// channel with the training set's mean and standard deviation; targets [B] int64.
//
// Every problem with the files (missing, a record cut short, a label outside 0-9, a read error)
// throws shoal::DataError with one line that names the file and says what is wrong.
//
// Thread safety: immutable after construction; get_batch may be called from any thread.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

#include "shoal/data/batch_dataset.h"

namespace shoal::data {

class Cifar10 : public BatchDataset {
 public:
  static constexpr int64_t kRecordBytes = 3073;
  static constexpr int64_t kChannels = 3;
  static constexpr int64_t kRows = 32;
  static constexpr int64_t kCols = 32;
  static constexpr int64_t kNumClasses = 10;
  /// Per-channel mean and standard deviation of the training images scaled to [0, 1] (the values
  /// PyTorch's CIFAR-10 examples normalise with).
  static constexpr double kMean[3] = {0.4914, 0.4822, 0.4465};
  static constexpr double kStd[3] = {0.2470, 0.2435, 0.2616};
  /// Most training files read (data_batch_1 ... data_batch_kMaxFiles): bounds what a folder makes
  /// the reader open.
  static constexpr int kMaxFiles = 1000;

  /// Reads the split's files under `root` (see above). Throws DataError.
  explicit Cifar10(const std::string& root, bool train = true, bool in_memory = false);
  ~Cifar10() override;
  Cifar10(const Cifar10&) = delete;
  Cifar10& operator=(const Cifar10&) = delete;

  int64_t size() const override { return targets_.size(0); }
  Batch get_batch(const at::Tensor& indices) const override;
  /// All labels, [N] int64.
  const at::Tensor& targets() const { return targets_; }

  /// True when `root` holds CIFAR-10 binary files (data_batch_1.bin or test_batch.bin).
  static bool present(const std::string& root);
  /// The files of a split under `root`, in sample order (only those that exist for training).
  static std::vector<std::string> files(const std::string& root, bool train);

 private:
  struct File {
    std::string path;
    int fd = -1;
    int64_t first = 0;    // index of its first sample
    int64_t records = 0;
  };
  std::vector<File> files_;
  at::Tensor targets_;
  at::Tensor images_;  // [N, 3, 32, 32] uint8 when in_memory
};

}  // namespace shoal::data
