#include "data/idx_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>
#if __has_include(<libdeflate.h>)
#include <libdeflate.h>
#define SHOAL_IDX_LIBDEFLATE 1
#endif

#include <ATen/Functions.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <limits>
#include <memory>

#include "data/regular_file.h"
#include "shoal/error.h"

namespace shoal::data::detail {
namespace {

// Decompression buffer per gzread call: large enough that call overhead does not matter, small
// enough to stay in cache.
constexpr unsigned kReadChunk = 1u << 20;

// Largest element count an IDX header may announce: 1 GiB, 20x Fashion-MNIST's training images
// (47 MB); a header beyond it is corrupt or hostile, and is refused before anything is allocated.
constexpr int64_t kMaxElements = int64_t{1} << 30;

uint32_t read_be32(const uint8_t* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | uint32_t{p[3]};
}

struct GzCloser {
  void operator()(gzFile_s* file) const { gzclose(file); }
};

// The most a file of `file_bytes` may decode to under `max_ratio` (0: no ratio check), header
// included: kIdxRatioFreeBytes whatever the ratio, more only within the ratio. read_idx refuses
// a header announcing more; inflate_whole never allocates more.
int64_t ratio_limit(int64_t file_bytes, double max_ratio) {
  if (max_ratio <= 0) return std::numeric_limits<int64_t>::max();
  const double by_ratio = max_ratio * static_cast<double>(std::max<int64_t>(file_bytes, 1));
  return std::max<int64_t>(kIdxRatioFreeBytes, static_cast<int64_t>(std::min(by_ratio, 1e18)));
}

// Files inflate_whole() has inflated in this process (idx_whole_file_inflations()).
std::atomic<uint64_t> whole_file_inflations{0};

// Gzip files up to this size may be inflated whole (inflate_whole), the compressed file held in
// memory beside the output; larger ones stream, in 1 MiB pieces (Fashion-MNIST's largest: 26 MB).
constexpr int64_t kWholeFileMaxBytes = int64_t{256} << 20;

/// A gzip file inflated at once (libdeflate: twice zlib's streaming speed), when that works at
/// all: a single gzip member whose size field (the trailer's ISIZE, which the file itself states)
/// is at most `max_decoded` and which inflates to exactly that many bytes. Undefined otherwise,
/// whatever the reason (not gzip, several members, damage, a size field that lies): the streaming
/// path then reads the file and says what is wrong with it.
at::Tensor inflate_whole(const std::string& path, int64_t file_bytes, int64_t max_decoded) {
#ifdef SHOAL_IDX_LIBDEFLATE
  if (file_bytes < 18 || file_bytes > kWholeFileMaxBytes) return {};  // 18: header + trailer
  std::vector<uint8_t> packed(static_cast<size_t>(file_bytes));
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return {};
  size_t got = 0;
  while (got < packed.size()) {
    const ssize_t n = ::read(fd, packed.data() + got, packed.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    got += static_cast<size_t>(n);
    if (got >= 2 && (packed[0] != 0x1f || packed[1] != 0x8b)) break;  // not gzip: streamed
  }
  ::close(fd);
  if (got != packed.size() || packed[0] != 0x1f || packed[1] != 0x8b) return {};
  const uint8_t* trailer = packed.data() + packed.size() - 4;
  const uint32_t isize = uint32_t{trailer[0]} | (uint32_t{trailer[1]} << 8) |
                         (uint32_t{trailer[2]} << 16) | (uint32_t{trailer[3]} << 24);
  if (isize == 0 || static_cast<int64_t>(isize) > max_decoded) return {};
  std::unique_ptr<libdeflate_decompressor, void (*)(libdeflate_decompressor*)> inflater(
      libdeflate_alloc_decompressor(), libdeflate_free_decompressor);
  if (!inflater) return {};
  at::Tensor out = at::empty({static_cast<int64_t>(isize)}, at::kByte);
  size_t used = 0;
  size_t produced = 0;
  const libdeflate_result result =
      libdeflate_gzip_decompress_ex(inflater.get(), packed.data(), packed.size(),
                                    out.data_ptr<uint8_t>(), isize, &used, &produced);
  if (result != LIBDEFLATE_SUCCESS || used != packed.size() || produced != isize) return {};
  whole_file_inflations.fetch_add(1, std::memory_order_relaxed);
  return out;
#else
  return {};
#endif
}

/// An IDX file (gzipped or plain) read as a stream, so that nothing beyond what its header
/// announces is ever decompressed: a small gzip that inflates to gigabytes is refused after the
/// expected size plus one byte.
class IdxStream {
 public:
  /// `max_ratio`: read_idx's decompression-ratio limit (0: none); a file is inflated whole only
  /// up to what read_idx could accept, so that path never allocates more than it would.
  IdxStream(const std::string& path, double max_ratio) : path_(path) {
    file_bytes_ = static_cast<int64_t>(require_regular_file<DataError>(path));
    const int64_t max_decoded =
        std::min<int64_t>(kMaxElements + 16, ratio_limit(file_bytes_, max_ratio));
    inflated_ = inflate_whole(path, file_bytes_, max_decoded);
    if (inflated_.defined()) return;
    file_.reset(gzopen(path.c_str(), "rb"));
    if (!file_) SHOAL_THROW(DataError, path, ": cannot open: ", std::strerror(errno));
    gzbuffer(file_.get(), kReadChunk);
  }

  /// The file's size on disk.
  int64_t file_bytes() const { return file_bytes_; }

  /// The next `count` bytes as a tensor (a view of the inflated file where it was inflated whole);
  /// `got` says how many there were (fewer only at the end of the data).
  at::Tensor read_tensor(int64_t count, size_t* got) {
    if (inflated_.defined() && offset_ + count <= inflated_.numel()) {
      at::Tensor view = inflated_.narrow(0, offset_, count);
      offset_ += count;
      consumed_ += static_cast<size_t>(count);
      *got = static_cast<size_t>(count);
      return view;
    }
    at::Tensor out = at::empty({count}, at::kByte);
    *got = read(out.data_ptr<uint8_t>(), static_cast<size_t>(count));
    return out;
  }

  /// Reads up to `size` bytes into `out`; returns how many (fewer only at the end of the data).
  size_t read(uint8_t* out, size_t size) {
    if (inflated_.defined()) {
      const size_t got = std::min<size_t>(size, static_cast<size_t>(inflated_.numel() - offset_));
      std::memcpy(out, inflated_.data_ptr<uint8_t>() + offset_, got);
      offset_ += static_cast<int64_t>(got);
      consumed_ += got;
      return got;
    }
    size_t got = 0;
    while (got < size) {
      const unsigned want = static_cast<unsigned>(std::min<size_t>(size - got, kReadChunk));
      const int n = gzread(file_.get(), out + got, want);
      if (n < 0) {
        int code = 0;
        const char* message = gzerror(file_.get(), &code);
        SHOAL_THROW(DataError, path_, ": corrupt gzip data after ", consumed_ + got,
                    " decompressed bytes: ", message);
      }
      if (n == 0) break;
      got += static_cast<size_t>(n);
    }
    consumed_ += got;
    if (got < size) check_clean_end();
    return got;
  }

  /// True when the stream holds nothing more (reads at most one byte).
  bool at_end() {
    uint8_t extra = 0;
    return read(&extra, 1) == 0;
  }

  size_t consumed() const { return consumed_; }

 private:
  void check_clean_end() {
    // A gzip stream cut short ends reads with no error code from gzread, only Z_BUF_ERROR here.
    int code = Z_OK;
    const char* message = gzerror(file_.get(), &code);
    if (code == Z_BUF_ERROR) {
      SHOAL_THROW(DataError, path_, ": truncated gzip stream (", message, ") after ", consumed_,
                  " decompressed bytes");
    }
    if (code != Z_OK) {
      SHOAL_THROW(DataError, path_, ": corrupt gzip data after ", consumed_, " decompressed bytes: ", message);
    }
  }

  std::string path_;
  int64_t file_bytes_ = 0;
  at::Tensor inflated_;  // the whole file, when inflate_whole() could read it; else file_ streams
  int64_t offset_ = 0;   // into inflated_
  std::unique_ptr<gzFile_s, GzCloser> file_;
  size_t consumed_ = 0;
};

/// Reads an IDX file's header and exactly the element bytes it announces (one byte per element);
/// returns the dimensions and fills `data`.
std::vector<int64_t> read_idx(const std::string& path, uint32_t expected_magic, int64_t num_dims,
                              const char* what, const char* items, double max_ratio, at::Tensor* data) {
  IdxStream stream(path, max_ratio);
  const size_t header_bytes = 4 + 4 * static_cast<size_t>(num_dims);
  uint8_t header[16] = {};
  const size_t got = stream.read(header, header_bytes);
  const auto too_short = [&] {
    SHOAL_THROW(DataError, path, ": truncated: ", got, " bytes, shorter than the ", header_bytes,
                "-byte header of an IDX ", what, " file");
  };
  // The magic number first: a wrong file is a better diagnosis than a short header.
  if (got < 4) too_short();
  const uint32_t magic = read_be32(header);
  if (magic != expected_magic) {
    const char* hint = magic == kIdxLabelsMagic   ? " (that of a label file)"
                       : magic == kIdxImagesMagic ? " (that of an image file)"
                                                  : "";
    SHOAL_THROW(DataError, path, ": bad magic number ", magic, hint, ", expected ", expected_magic,
                " for an IDX ", what, " file: wrong or corrupt file");
  }
  if (got < header_bytes) too_short();
  std::vector<int64_t> dims(num_dims);
  int64_t elements = 1;
  for (int64_t i = 0; i < num_dims; ++i) {
    dims[i] = read_be32(header + 4 + 4 * i);
    // Each dimension is below 2^32, so the product of three stays below 2^96: check as it grows.
    if (__builtin_mul_overflow(elements, dims[i], &elements) || elements > kMaxElements) {
      SHOAL_THROW(DataError, path, ": corrupt: the header announces more than ", kMaxElements,
                  " bytes of ", items);
    }
  }
  // A header may announce up to kMaxElements, which a 1 MB gzip of zeros can deliver: 1 GB here,
  // 4 GB once the images are floats, per process. Real image sets decode to 2-5x their gzipped size
  // (Fashion-MNIST 1.8x, MNIST 4.8x): far more than that needs the caller's explicit consent.
  const int64_t file_bytes = stream.file_bytes();
  const int64_t decoded = static_cast<int64_t>(header_bytes) + elements;
  if (decoded > ratio_limit(file_bytes, max_ratio)) {
    SHOAL_THROW(DataError, path, ": the header announces ", decoded, " bytes of ", what, " data from a file of ",
                file_bytes, " bytes (", static_cast<int64_t>(static_cast<double>(decoded) / std::max<int64_t>(file_bytes, 1)),
                ":1, more than the ", max_ratio, ":1 real image files come near): refused as a decompression bomb "
                "before allocating it; if the file is genuine, raise --max-decompression-ratio (0: no check; "
                "FashionMnist's max_decompression_ratio)");
  }
  size_t body = 0;
  *data = stream.read_tensor(elements, &body);
  if (body < static_cast<size_t>(elements)) {
    SHOAL_THROW(DataError, path, ": truncated: expected ", header_bytes + elements, " bytes of ", what,
                " data (", dims[0], " ", items, " and a ", header_bytes, "-byte header), got ",
                header_bytes + body);
  }
  if (!stream.at_end()) {
    SHOAL_THROW(DataError, path, ": corrupt: more bytes after the end of the ", dims[0], " ", items,
                " the header announces");
  }
  return dims;
}

}  // namespace

at::Tensor read_idx_images(const std::string& path, int64_t expected_rows, int64_t expected_cols,
                           double max_decompression_ratio) {
  at::Tensor data;
  const std::vector<int64_t> dims =
      read_idx(path, kIdxImagesMagic, 3, "image", "images", max_decompression_ratio, &data);
  const int64_t count = dims[0], rows = dims[1], cols = dims[2];
  if (rows != expected_rows || cols != expected_cols) {
    SHOAL_THROW(DataError, path, ": images are ", rows, "x", cols, ", expected ", expected_rows,
                "x", expected_cols);
  }
  return data.view({count, rows, cols});
}

at::Tensor read_idx_labels(const std::string& path, int64_t num_classes, double max_decompression_ratio) {
  at::Tensor data;
  const std::vector<int64_t> dims =
      read_idx(path, kIdxLabelsMagic, 1, "label", "labels", max_decompression_ratio, &data);
  const int64_t count = dims[0];
  at::Tensor labels = at::empty({count}, at::kLong);
  const uint8_t* in = data.data_ptr<uint8_t>();
  int64_t* out = labels.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i) {
    const int64_t label = in[i];
    if (label >= num_classes) {
      SHOAL_THROW(DataError, path, ": corrupt: label ", label, " at index ", i,
                  " is outside [0, ", num_classes, ")");
    }
    out[i] = label;
  }
  return labels;
}

bool idx_whole_file_inflation_built() {
#ifdef SHOAL_IDX_LIBDEFLATE
  return true;
#else
  return false;
#endif
}

uint64_t idx_whole_file_inflations() {
  return whole_file_inflations.load(std::memory_order_relaxed);
}

}  // namespace shoal::data::detail
