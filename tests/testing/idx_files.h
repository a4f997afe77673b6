// Test helpers that write IDX files (gzipped), whole or damaged, and small Fashion-MNIST-shaped
// data directories, so data-loading errors and the CLI can be tested without the real files.
//
// Thread safety: free functions; callers use distinct paths.
#pragma once

#include <sys/stat.h>
#include <zlib.h>

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

namespace shoal::testing {

/// Where Debian's dataset-fashion-mnist installs the real files.
inline const char* real_fashion_mnist_dir() { return "/usr/share/datasets/fashion-mnist"; }

/// True when the real Fashion-MNIST files are installed.
inline bool have_real_fashion_mnist() {
  struct stat info {};
  return ::stat((std::string(real_fashion_mnist_dir()) + "/train-images-idx3-ubyte.gz").c_str(),
                &info) == 0;
}

/// A fresh, empty directory under $TMPDIR (or /tmp).
inline std::string make_temp_dir(const std::string& stem) {
  const char* base = std::getenv("TMPDIR");
  std::string pattern = std::string(base ? base : "/tmp") + "/" + stem + "-XXXXXX";
  if (::mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed: " + pattern);
  return pattern;
}

/// Writes `bytes` gzip-compressed to `path`.
inline void write_gzip(const std::string& path, const std::vector<uint8_t>& bytes) {
  gzFile file = gzopen(path.c_str(), "wb1");
  if (file == nullptr) throw std::runtime_error("cannot create " + path);
  if (!bytes.empty() &&
      gzwrite(file, bytes.data(), static_cast<unsigned>(bytes.size())) != static_cast<int>(bytes.size())) {
    gzclose(file);
    throw std::runtime_error("cannot write " + path);
  }
  gzclose(file);
}

/// Writes raw bytes to `path` (no compression).
inline void write_raw(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  if (!out) throw std::runtime_error("cannot write " + path);
}

/// The raw bytes of `path`.
inline std::vector<uint8_t> read_raw(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

/// The first `count` decompressed bytes of the gzip file `path`.
inline std::vector<uint8_t> read_gzip_prefix(const std::string& path, size_t count) {
  gzFile file = gzopen(path.c_str(), "rb");
  if (file == nullptr) throw std::runtime_error("cannot open " + path);
  std::vector<uint8_t> bytes(count);
  const int n = gzread(file, bytes.data(), static_cast<unsigned>(count));
  gzclose(file);
  if (n < 0) throw std::runtime_error("cannot read " + path);
  bytes.resize(static_cast<size_t>(n));
  return bytes;
}

inline void append_be32(std::vector<uint8_t>& out, uint32_t value) {
  out.push_back(static_cast<uint8_t>(value >> 24));
  out.push_back(static_cast<uint8_t>(value >> 16));
  out.push_back(static_cast<uint8_t>(value >> 8));
  out.push_back(static_cast<uint8_t>(value));
}

/// An IDX image file's content: `count` images of rows x cols; pixel (i, k) = (i * 7 + k) % 256.
inline std::vector<uint8_t> idx_images(uint32_t count, uint32_t rows = 28, uint32_t cols = 28,
                                       uint32_t magic = 2051) {
  std::vector<uint8_t> out;
  append_be32(out, magic);
  append_be32(out, count);
  append_be32(out, rows);
  append_be32(out, cols);
  for (uint32_t i = 0; i < count; ++i) {
    for (uint32_t k = 0; k < rows * cols; ++k) out.push_back(static_cast<uint8_t>((i * 7 + k) % 256));
  }
  return out;
}

/// An IDX label file's content: `count` labels, label i = i % 10.
inline std::vector<uint8_t> idx_labels(uint32_t count, uint32_t magic = 2049) {
  std::vector<uint8_t> out;
  append_be32(out, magic);
  append_be32(out, count);
  for (uint32_t i = 0; i < count; ++i) out.push_back(static_cast<uint8_t>(i % 10));
  return out;
}

/// A directory holding a complete, small Fashion-MNIST-shaped dataset (train and t10k files).
inline std::string make_small_dataset_dir(uint32_t train_count, uint32_t test_count) {
  const std::string dir = make_temp_dir("shoal-idx");
  write_gzip(dir + "/train-images-idx3-ubyte.gz", idx_images(train_count));
  write_gzip(dir + "/train-labels-idx1-ubyte.gz", idx_labels(train_count));
  write_gzip(dir + "/t10k-images-idx3-ubyte.gz", idx_images(test_count));
  write_gzip(dir + "/t10k-labels-idx1-ubyte.gz", idx_labels(test_count));
  return dir;
}

}  // namespace shoal::testing
