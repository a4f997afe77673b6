// Reading IDX files (the MNIST family's format), gzipped or not, with checks that turn every kind
// of damage into a shoal::DataError whose message starts with the file's path.
//
// IDX layout (big-endian): a 4-byte magic number whose low byte is the number of dimensions and
// whose third byte is the element type (0x08 = unsigned byte), one 4-byte size per dimension, then
// the elements. Image files have magic 2051 (0x00000803, 3 dims), label files 2049 (0x00000801).
//
// Thread safety: free functions without shared state.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

namespace shoal::data::detail {

/// The magic number of an IDX file of unsigned-byte images [N, rows, cols].
constexpr uint32_t kIdxImagesMagic = 2051;
/// The magic number of an IDX file of unsigned-byte labels [N].
constexpr uint32_t kIdxLabelsMagic = 2049;

/// Decoded sizes up to this are always accepted, whatever the ratio: small hand-made or test
/// files of uniform pixels compress far better than real images.
constexpr int64_t kIdxRatioFreeBytes = int64_t{64} << 20;

/// Images [N, rows, cols] uint8 from an IDX image file; checks magic, header and size, and that
/// rows x cols equals the expected dimensions. A file whose header announces more than
/// kIdxRatioFreeBytes and more than `max_decompression_ratio` times the file's own size is
/// refused before anything is allocated (0: no ratio check).
at::Tensor read_idx_images(const std::string& path, int64_t expected_rows, int64_t expected_cols,
                           double max_decompression_ratio);

/// Labels [N] int64 from an IDX label file; checks magic, header, size and that every label is
/// in [0, num_classes); the ratio check as for images.
at::Tensor read_idx_labels(const std::string& path, int64_t num_classes, double max_decompression_ratio);

/// Whether this build inflates gzipped IDX files of one member whole (libdeflate found at build
/// time); without it every gzipped file streams through zlib.
bool idx_whole_file_inflation_built();

/// How many files this process has inflated whole so far (diagnostics and tests).
uint64_t idx_whole_file_inflations();

}  // namespace shoal::data::detail
