// A dataset saved from Python as one torch.save file of four tensors:
//
//   torch.save({"train_x": X, "train_y": y, "test_x": Xt, "test_y": yt}, "data.pt")
//
// read through checkpoint::load (the restricted reader, with its size bounds: no code runs, no
// record may claim more than the file holds). Inputs must be floating point ([N, ...]; float64,
// float16 and bfloat16 are converted to float32); targets, as TensorFileOptions::targets says,
// integer class indices [N] (any integer dtype, converted to int64) in [0, num_classes) when
// num_classes is given, float regression targets [N, ...], or a language model's blocks of token
// ids. For a model that computes its own loss, inputs and targets are taken as saved. Every
// problem (a missing key, a value that is not a tensor, a wrong dtype or shape, counts that
// disagree, a label out of range) throws DataError with one line that names the file, the key
// and what to do.
//
// Thread safety: a function of its arguments.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

namespace shoal::data {

struct TensorFileData {
  at::Tensor train_x, train_y, test_x, test_y;
};

/// What read_tensor_file accepts.
struct TensorFileOptions {
  enum class Targets {
    kClasses,  ///< integer class indices [N] in [0, num_classes)
    kValues,   ///< floating-point regression targets [N, ...], converted to float32
    kAsSaved,  ///< inputs and targets [N, ...] of any dtype, as saved
    kTokens,   ///< a language model's blocks: integer token ids [N, T] as inputs and targets
               ///< (targets may be -1: ignored), converted to int64
  };
  Targets targets = Targets::kClasses;
  /// The labels' bound with kClasses, the vocabulary's with kTokens; 0 skips the range check.
  int64_t num_classes = 0;
};

/// Reads and checks `path` (see above).
TensorFileData read_tensor_file(const std::string& path, const TensorFileOptions& options);
/// The same for class targets; num_classes 0 skips the label range check.
TensorFileData read_tensor_file(const std::string& path, int64_t num_classes = 0);

}  // namespace shoal::data
