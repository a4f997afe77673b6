#include "shoal/data/token_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "shoal/error.h"

namespace shoal::data {
namespace {

// Tokens check_vocab() reads between releases of its pages: 16 MiB of uint32, so that a scan of
// a file larger than memory keeps only this much of it mapped.
constexpr int64_t kScanChunkTokens = int64_t{1} << 22;

size_t page_size() {
  static const size_t size = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  return size;
}

/// The byte range [begin, end) widened to whole pages, clipped to the mapping.
std::pair<size_t, size_t> page_range(size_t begin, size_t end, size_t mapped) {
  const size_t page = page_size();
  return {begin / page * page, std::min(mapped, (end + page - 1) / page * page)};
}

// Token files are little-endian (numpy's tofile() on every machine nanoGPT runs on); the copy
// converts on a big-endian host.
template <typename T>
T little_endian(const unsigned char* p) {
  T value;
  std::memcpy(&value, p, sizeof(T));
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
  if constexpr (sizeof(T) == 2) value = __builtin_bswap16(value);
  if constexpr (sizeof(T) == 4) value = __builtin_bswap32(value);
#endif
  return value;
}

/// Copies `count` tokens of type T to `out`; returns the largest.
template <typename T>
int64_t copy_tokens(const unsigned char* from, int64_t count, int64_t* out) {
  T largest = 0;
  for (int64_t i = 0; i < count; ++i) {
    const T value = little_endian<T>(from + i * static_cast<int64_t>(sizeof(T)));
    largest = std::max(largest, value);
    out[i] = static_cast<int64_t>(value);
  }
  return static_cast<int64_t>(largest);
}

}  // namespace

TokenDtype parse_token_dtype(const std::string& name) {
  if (name == "uint16") return TokenDtype::kUInt16;
  if (name == "uint32") return TokenDtype::kUInt32;
  SHOAL_THROW(InvalidArgument, "token dtype '", name, "' is not uint16 or uint32");
}

const char* token_dtype_name(TokenDtype dtype) {
  return dtype == TokenDtype::kUInt16 ? "uint16" : "uint32";
}

int64_t token_width(TokenDtype dtype) { return dtype == TokenDtype::kUInt16 ? 2 : 4; }

TokenFile::TokenFile(std::string path, TokenFileOptions options)
    : path_(std::move(path)), options_(options), width_(token_width(options.dtype)) {
  SHOAL_CHECK_T(InvalidArgument, options_.vocab_size >= 0, "token file ", path_,
                ": the vocabulary size is ", options_.vocab_size, "; it must be 0 (no check) or more");
  const int fd = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
  SHOAL_CHECK_T(DataError, fd >= 0, "token file ", path_, ": cannot open: ", std::strerror(errno));
  struct stat info {};
  const bool stated = ::fstat(fd, &info) == 0;
  const int stat_error = errno;
  if (!stated || !S_ISREG(info.st_mode) || info.st_size == 0 || info.st_size % width_ != 0) {
    ::close(fd);
    SHOAL_CHECK_T(DataError, stated, "token file ", path_, ": cannot stat: ", std::strerror(stat_error));
    SHOAL_CHECK_T(DataError, S_ISREG(info.st_mode), "token file ", path_, " is not a regular file");
    SHOAL_CHECK_T(DataError, info.st_size > 0, "token file ", path_, " is empty");
    SHOAL_THROW(DataError, "token file ", path_, " has ", static_cast<int64_t>(info.st_size),
                " bytes, not a multiple of ", width_, " (the width of ",
                width_ == 2 ? "uint16" : "uint32", " tokens): truncated, or written with another dtype?");
  }
  mapped_bytes_ = static_cast<size_t>(info.st_size);
  size_ = static_cast<int64_t>(info.st_size) / width_;
  void* mapped = ::mmap(nullptr, mapped_bytes_, PROT_READ, MAP_SHARED, fd, 0);
  const int map_error = errno;
  ::close(fd);  // the mapping keeps the file
  SHOAL_CHECK_T(DataError, mapped != MAP_FAILED, "token file ", path_, ": mmap of ", mapped_bytes_,
                " bytes failed: ", std::strerror(map_error));
  data_ = static_cast<const unsigned char*>(mapped);
  ::madvise(mapped, mapped_bytes_, options_.sequential ? MADV_SEQUENTIAL : MADV_RANDOM);
}

TokenFile::~TokenFile() {
  if (data_ != nullptr) ::munmap(const_cast<unsigned char*>(data_), mapped_bytes_);
}

at::Tensor TokenFile::read(int64_t offset, int64_t count) const {
  at::Tensor out = at::empty({std::max<int64_t>(count, 0)}, at::kLong);
  read_into(offset, count, out.data_ptr<int64_t>());
  return out;
}

void TokenFile::read_into(int64_t offset, int64_t count, int64_t* out) const {
  SHOAL_CHECK_T(InvalidArgument, offset >= 0 && count >= 0 && offset <= size_ - count,
                "token file ", path_, ": tokens [", offset, ", ", offset + count,
                ") are outside the file's ", size_, " tokens");
  const unsigned char* from = data_ + offset * width_;
  const int64_t largest = width_ == 2 ? copy_tokens<uint16_t>(from, count, out)
                                      : copy_tokens<uint32_t>(from, count, out);
  release(offset, count);
  if (options_.vocab_size > 0 && largest >= options_.vocab_size) throw_out_of_vocab(offset, count);
}

void TokenFile::throw_out_of_vocab(int64_t offset, int64_t count) const {
  for (int64_t i = offset; i < offset + count; ++i) {
    const unsigned char* p = data_ + i * width_;
    const int64_t id = width_ == 2 ? little_endian<uint16_t>(p) : little_endian<uint32_t>(p);
    if (id >= options_.vocab_size) {
      SHOAL_THROW(DataError, "token file ", path_, ": token ", id, " at offset ", i, " (byte ",
                  i * width_, ") is not below the vocabulary size ", options_.vocab_size,
                  " (written by another tokenizer, or the wrong --vocab-size?)");
    }
  }
  SHOAL_THROW(DataError, "token file ", path_, " changed while it was read");
}

void TokenFile::prefetch(int64_t offset, int64_t count) const {
  if (count <= 0 || offset < 0 || offset >= size_) return;
  const auto end = static_cast<size_t>(std::min(size_, offset + count) * width_);
  const auto [begin, stop] = page_range(static_cast<size_t>(offset * width_), end, mapped_bytes_);
  ::madvise(const_cast<unsigned char*>(data_) + begin, stop - begin, MADV_WILLNEED);
}

void TokenFile::release(int64_t offset, int64_t count) const {
  if (count <= 0) return;
  const auto [begin, stop] = page_range(static_cast<size_t>(offset * width_),
                                        static_cast<size_t>((offset + count) * width_), mapped_bytes_);
  // A read-only shared mapping's pages are the page cache's: MADV_DONTNEED only unmaps them here
  // (a concurrent read of a neighbouring block that shares an edge page faults it back in).
  ::madvise(const_cast<unsigned char*>(data_) + begin, stop - begin, MADV_DONTNEED);
}

int64_t TokenFile::check_vocab() const {
  std::vector<int64_t> chunk(static_cast<size_t>(std::min(size_, kScanChunkTokens)));
  int64_t largest = 0;
  for (int64_t offset = 0; offset < size_; offset += kScanChunkTokens) {
    const int64_t count = std::min(kScanChunkTokens, size_ - offset);
    prefetch(offset + count, kScanChunkTokens);  // the next chunk reads while this one is checked
    read_into(offset, count, chunk.data());
    largest = std::max(largest, *std::max_element(chunk.begin(), chunk.begin() + count));
  }
  return largest;
}

}  // namespace shoal::data
