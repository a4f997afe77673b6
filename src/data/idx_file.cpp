#include "data/idx_file.h"

#include <sys/stat.h>
#include <zlib.h>

#include <cerrno>
#include <cstring>
#include <memory>

#include "shoal/error.h"

namespace shoal::data::detail {
namespace {

// Decompression buffer per gzread call: large enough that call overhead does not matter, small
// enough to stay in cache.
constexpr unsigned kReadChunk = 1u << 20;

uint32_t read_be32(const uint8_t* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | uint32_t{p[3]};
}

struct GzCloser {
  void operator()(gzFile_s* file) const { gzclose(file); }
};

// Checks magic number and header length; returns the dimension sizes.
std::vector<int64_t> read_header(const std::string& path, const std::vector<uint8_t>& bytes,
                                 uint32_t expected_magic, int64_t num_dims, const char* what) {
  const size_t header_bytes = 4 + 4 * static_cast<size_t>(num_dims);
  const auto too_short = [&] {
    SHOAL_THROW(DataError, path, ": truncated: ", bytes.size(), " bytes, shorter than the ",
                header_bytes, "-byte header of an IDX ", what, " file");
  };
  // The magic number first: a wrong file is a better diagnosis than a short header.
  if (bytes.size() < 4) too_short();
  const uint32_t magic = read_be32(bytes.data());
  if (magic != expected_magic) {
    const char* hint = magic == kIdxLabelsMagic   ? " (that of a label file)"
                       : magic == kIdxImagesMagic ? " (that of an image file)"
                                                  : "";
    SHOAL_THROW(DataError, path, ": bad magic number ", magic, hint, ", expected ", expected_magic,
                " for an IDX ", what, " file: wrong or corrupt file");
  }
  if (bytes.size() < header_bytes) too_short();
  std::vector<int64_t> dims(num_dims);
  for (int64_t i = 0; i < num_dims; ++i) dims[i] = read_be32(bytes.data() + 4 + 4 * i);
  return dims;
}

}  // namespace

std::vector<uint8_t> read_gzip_file(const std::string& path) {
  struct stat info {};
  if (::stat(path.c_str(), &info) != 0) {
    const int err = errno;
    if (err == ENOENT) SHOAL_THROW(DataError, path, ": file not found");
    SHOAL_THROW(DataError, path, ": cannot open: ", std::strerror(err));
  }
  if (S_ISDIR(info.st_mode)) SHOAL_THROW(DataError, path, ": is a directory, expected a file");

  std::unique_ptr<gzFile_s, GzCloser> file(gzopen(path.c_str(), "rb"));
  if (!file) SHOAL_THROW(DataError, path, ": cannot open: ", std::strerror(errno));
  gzbuffer(file.get(), kReadChunk);

  std::vector<uint8_t> bytes;
  // Fashion-MNIST's images compress to about half their size; this avoids most regrowth.
  bytes.reserve(static_cast<size_t>(info.st_size) * 2);
  std::vector<uint8_t> chunk(kReadChunk);
  for (;;) {
    const int n = gzread(file.get(), chunk.data(), kReadChunk);
    if (n < 0) {
      int code = 0;
      const char* message = gzerror(file.get(), &code);
      SHOAL_THROW(DataError, path, ": corrupt gzip data after ", bytes.size(),
                  " decompressed bytes: ", message);
    }
    if (n == 0) break;
    bytes.insert(bytes.end(), chunk.data(), chunk.data() + n);
  }
  // A gzip stream cut short ends reads with no error code from gzread, only Z_BUF_ERROR here.
  int code = Z_OK;
  const char* message = gzerror(file.get(), &code);
  if (code == Z_BUF_ERROR) {
    SHOAL_THROW(DataError, path, ": truncated gzip stream (", message, ") after ", bytes.size(),
                " decompressed bytes");
  }
  if (code != Z_OK) {
    SHOAL_THROW(DataError, path, ": corrupt gzip data after ", bytes.size(),
                " decompressed bytes: ", message);
  }
  return bytes;
}

at::Tensor read_idx_images(const std::string& path, int64_t expected_rows, int64_t expected_cols) {
  const std::vector<uint8_t> bytes = read_gzip_file(path);
  const std::vector<int64_t> dims = read_header(path, bytes, kIdxImagesMagic, 3, "image");
  const int64_t count = dims[0], rows = dims[1], cols = dims[2];
  if (rows != expected_rows || cols != expected_cols) {
    SHOAL_THROW(DataError, path, ": images are ", rows, "x", cols, ", expected ", expected_rows,
                "x", expected_cols);
  }
  const size_t header = 16;
  const size_t expected = header + static_cast<size_t>(count * rows * cols);
  if (bytes.size() < expected) {
    SHOAL_THROW(DataError, path, ": truncated: expected ", expected, " bytes of image data (",
                count, " images of ", rows, "x", cols, " and a ", header, "-byte header), got ",
                bytes.size());
  }
  if (bytes.size() > expected) {
    SHOAL_THROW(DataError, path, ": corrupt: ", bytes.size() - expected,
                " bytes after the end of the ", count, " images the header announces");
  }
  at::Tensor images = at::empty({count, rows, cols}, at::kByte);
  std::memcpy(images.data_ptr<uint8_t>(), bytes.data() + header, expected - header);
  return images;
}

at::Tensor read_idx_labels(const std::string& path, int64_t num_classes) {
  const std::vector<uint8_t> bytes = read_gzip_file(path);
  const std::vector<int64_t> dims = read_header(path, bytes, kIdxLabelsMagic, 1, "label");
  const int64_t count = dims[0];
  const size_t header = 8;
  const size_t expected = header + static_cast<size_t>(count);
  if (bytes.size() < expected) {
    SHOAL_THROW(DataError, path, ": truncated: expected ", expected, " bytes of label data (",
                count, " labels and an ", header, "-byte header), got ", bytes.size());
  }
  if (bytes.size() > expected) {
    SHOAL_THROW(DataError, path, ": corrupt: ", bytes.size() - expected,
                " bytes after the end of the ", count, " labels the header announces");
  }
  at::Tensor labels = at::empty({count}, at::kLong);
  int64_t* out = labels.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i) {
    const int64_t label = bytes[header + i];
    if (label >= num_classes) {
      SHOAL_THROW(DataError, path, ": corrupt: label ", label, " at index ", i,
                  " is outside [0, ", num_classes, ")");
    }
    out[i] = label;
  }
  return labels;
}

}  // namespace shoal::data::detail
