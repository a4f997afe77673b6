// A seeded, deterministic, learnable synthetic classification dataset.
//
// Inputs are standard-normal samples of a configurable shape (Fashion-MNIST's [1,28,28] by
// default); each label is the argmax of a fixed random linear "teacher" applied to the flattened
// input, so a model can learn it and a loss that falls is a real signal. The same options give the
// same tensors bit for bit, which makes it the data of choice for tests and benchmarks that must
// not depend on files.
//
// Thread safety: immutable after construction; const methods may be called from any thread.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/data/datasets/base.h>
#include <torch/data/example.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace shoal::data {

/// What SyntheticDataset generates.
struct SyntheticOptions {
  /// Number of samples.
  int64_t size = 1024;
  /// Shape of one input sample.
  std::vector<int64_t> sample_shape = {1, 28, 28};
  /// Number of classes (labels are in [0, num_classes)).
  int64_t num_classes = 10;
  /// Seeds inputs and teacher; the same seed gives bit-identical data.
  uint64_t seed = 0;
};

/// Standard-normal inputs labelled by a fixed random linear teacher.
class SyntheticDataset : public torch::data::datasets::Dataset<SyntheticDataset> {
 public:
  explicit SyntheticDataset(SyntheticOptions options = {});

  /// One input of shape options.sample_shape and its label (0-dim int64).
  torch::data::Example<> get(size_t index) override;
  c10::optional<size_t> size() const override;

  /// All inputs, [size, sample_shape...] float32.
  const at::Tensor& images() const { return images_; }
  /// All labels, [size] int64.
  const at::Tensor& targets() const { return targets_; }
  const SyntheticOptions& options() const { return options_; }

 private:
  SyntheticOptions options_;
  at::Tensor images_;
  at::Tensor targets_;
};

}  // namespace shoal::data
