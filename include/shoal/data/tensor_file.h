// A dataset saved from Python as one torch.save file of four tensors:
//
//   torch.save({"train_x": X, "train_y": y, "test_x": Xt, "test_y": yt}, "data.pt")
//
// read through checkpoint::load (the restricted reader, with its size bounds: no code runs, no
// record may claim more than the file holds). Inputs must be floating point ([N, ...]; float64,
// float16 and bfloat16 are converted to float32); targets integer class indices [N] (any integer
// dtype, converted to int64) in [0, num_classes) when num_classes is given. Every problem (a
// missing key, a value that is not a tensor, a wrong dtype or shape, counts that disagree, a label
// out of range) throws DataError with one line that names the file, the key and what to do.
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

/// Reads and checks `path` (see above); num_classes 0 skips the label range check.
TensorFileData read_tensor_file(const std::string& path, int64_t num_classes = 0);

}  // namespace shoal::data
