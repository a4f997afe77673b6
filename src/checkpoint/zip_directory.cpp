#include "checkpoint/zip_directory.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "shoal/error.h"

namespace shoal::checkpoint::detail {
namespace {

constexpr uint32_t kEndOfDirectory = 0x06054b50;
constexpr uint32_t kZip64EndLocator = 0x07064b50;
constexpr uint32_t kZip64End = 0x06064b50;
constexpr uint32_t kDirectoryEntry = 0x02014b50;
constexpr size_t kEndSize = 22;
constexpr size_t kEntrySize = 46;
// The end record may be followed by a comment of up to 64 KiB.
constexpr size_t kMaxComment = 0xFFFF;
// More records than any checkpoint holds (one per tensor storage); bounds the vector.
constexpr uint64_t kMaxEntries = 1u << 20;

uint64_t le(const uint8_t* p, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// The bytes [base, base + length) of a file (all of it by default), read from offset 0.
class File {
 public:
  File(const std::string& path, uint64_t base, uint64_t length)
      : path_(path), fd_(::open(path.c_str(), O_RDONLY | O_CLOEXEC)), base_(base) {
    SHOAL_CHECK_T(CheckpointError, fd_ >= 0, path, ": cannot open: ", std::strerror(errno));
    struct stat info {};
    SHOAL_CHECK_T(CheckpointError, ::fstat(fd_, &info) == 0, path, ": cannot stat: ", std::strerror(errno));
    const auto file_size = static_cast<uint64_t>(info.st_size);
    if (base > file_size) fail("the archive starts past the end of the file");
    size_ = std::min(length, file_size - base);
  }
  ~File() { ::close(fd_); }
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  uint64_t size() const { return size_; }

  std::vector<uint8_t> read(uint64_t offset, uint64_t length, const char* what) const {
    if (offset > size_ || length > size_ - offset) fail(what, " lies outside the file");
    std::vector<uint8_t> out(length);
    size_t done = 0;
    while (done < length) {
      const ssize_t n = ::pread(fd_, out.data() + done, length - done,
                                static_cast<off_t>(base_ + offset + done));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) fail("cannot read ", what, n < 0 ? std::strerror(errno) : "");
      done += static_cast<size_t>(n);
    }
    return out;
  }

  template <typename... Parts>
  [[noreturn]] void fail(const Parts&... parts) const {
    SHOAL_THROW(CheckpointError, path_, ": is truncated or corrupt (zip directory: ", parts..., ")");
  }

 private:
  std::string path_;
  int fd_;
  uint64_t base_ = 0;
  uint64_t size_ = 0;
};

}  // namespace

ZipDirectory::ZipDirectory(const std::string& path) : ZipDirectory(path, 0, UINT64_MAX) {}

ZipDirectory::ZipDirectory(const std::string& path, uint64_t offset, uint64_t length) {
  File file(path, offset, length);
  file_size_ = file.size();
  if (file_size_ < kEndSize) file.fail("shorter than a zip end record");
  const uint64_t tail_size = std::min<uint64_t>(file_size_, kEndSize + kMaxComment);
  const std::vector<uint8_t> tail = file.read(file_size_ - tail_size, tail_size, "the end record");
  // The end record is the last signature that fits with its comment.
  size_t end = std::string::npos;
  for (size_t i = tail_size - kEndSize + 1; i-- > 0;) {
    if (le(&tail[i], 4) == kEndOfDirectory && i + kEndSize + le(&tail[i + 20], 2) == tail_size) {
      end = i;
      break;
    }
  }
  if (end == std::string::npos) file.fail("no end record");
  const uint64_t end_offset = file_size_ - tail_size + end;
  uint64_t count = le(&tail[end + 10], 2);
  uint64_t directory_size = le(&tail[end + 12], 4);
  uint64_t directory_offset = le(&tail[end + 16], 4);
  if (count == 0xFFFF || directory_size == 0xFFFFFFFF || directory_offset == 0xFFFFFFFF) {
    if (end_offset < 20) file.fail("no zip64 locator");
    const auto locator = file.read(end_offset - 20, 20, "the zip64 locator");
    if (le(locator.data(), 4) != kZip64EndLocator) file.fail("no zip64 locator");
    const auto end64 = file.read(le(&locator[8], 8), 56, "the zip64 end record");
    if (le(end64.data(), 4) != kZip64End) file.fail("bad zip64 end record");
    count = le(&end64[32], 8);
    directory_size = le(&end64[40], 8);
    directory_offset = le(&end64[48], 8);
  }
  if (count > kMaxEntries || count * kEntrySize > directory_size) file.fail(count, " records declared");
  const auto directory = file.read(directory_offset, directory_size, "the central directory");
  size_t pos = 0;
  for (uint64_t i = 0; i < count; ++i) {
    if (directory.size() - pos < kEntrySize || le(&directory[pos], 4) != kDirectoryEntry) {
      file.fail("record ", i, " is malformed");
    }
    const uint8_t* e = &directory[pos];
    Entry entry;
    entry.method = static_cast<uint16_t>(le(e + 10, 2));
    entry.compressed_size = le(e + 20, 4);
    entry.uncompressed_size = le(e + 24, 4);
    entry.local_header_offset = le(e + 42, 4);
    const size_t name_size = le(e + 28, 2), extra_size = le(e + 30, 2), comment_size = le(e + 32, 2);
    if (directory.size() - pos - kEntrySize < name_size + extra_size + comment_size) {
      file.fail("record ", i, " runs past the directory");
    }
    entry.name.assign(reinterpret_cast<const char*>(e + kEntrySize), name_size);
    // Zip64 extra field (id 1): 8-byte values for those fields that hold 0xFFFFFFFF, in order.
    const uint8_t* extra = e + kEntrySize + name_size;
    for (size_t x = 0; x + 4 <= extra_size;) {
      const uint64_t id = le(extra + x, 2), size = le(extra + x + 2, 2);
      if (x + 4 + size > extra_size) file.fail("record ", i, " has a malformed extra field");
      if (id == 1) {
        size_t at = x + 4;
        for (uint64_t* field : {&entry.uncompressed_size, &entry.compressed_size, &entry.local_header_offset}) {
          if (*field != 0xFFFFFFFF) continue;
          if (at + 8 > x + 4 + size) file.fail("record ", i, " has a short zip64 field");
          *field = le(extra + at, 8);
          at += 8;
        }
      }
      x += 4 + size;
    }
    if (entry.local_header_offset > file_size_ || entry.compressed_size > file_size_ - entry.local_header_offset) {
      file.fail("record '", entry.name, "' lies outside the file");
    }
    entries_.push_back(std::move(entry));
    pos += kEntrySize + name_size + extra_size + comment_size;
  }
}

std::string record_name(const ZipDirectory::Entry& entry) {
  const size_t slash = entry.name.find('/');
  return slash == std::string::npos ? entry.name : entry.name.substr(slash + 1);
}

void check_declared_sizes(const ZipDirectory& directory, const std::string& path) {
  uint64_t inflated = 0;
  for (const auto& entry : directory.entries()) {
    const std::string record = record_name(entry);
    if (entry.method == 0) {
      SHOAL_CHECK_T(CheckpointError, entry.compressed_size == entry.uncompressed_size, path,
                    ": record '", record, "' declares ", entry.uncompressed_size, " bytes but stores ",
                    entry.compressed_size, ": the file is corrupt");
      continue;
    }
    SHOAL_CHECK_T(CheckpointError, entry.method == 8, path, ": record '", record,
                  "' uses zip compression method ", entry.method, ", which torch.save never writes");
    const bool tensor = record.rfind("data/", 0) == 0 || record.rfind("constants/", 0) == 0;
    SHOAL_CHECK_T(CheckpointError, !tensor, path, ": tensor record '", record, "' is compressed (",
                  entry.compressed_size, " bytes inflating to ", entry.uncompressed_size,
                  "); torch.save stores tensors uncompressed, so Shoal does not inflate it");
    SHOAL_CHECK_T(CheckpointError, entry.uncompressed_size <= kMaxInflatedRecord, path, ": record '", record,
                  "' inflates to ", entry.uncompressed_size, " bytes from ", entry.compressed_size,
                  " (more than ", kMaxInflatedRecord, "): refused");
    inflated += entry.uncompressed_size;
    SHOAL_CHECK_T(CheckpointError, inflated <= kMaxInflatedTotal, path, ": its compressed records inflate to ",
                  "more than ", kMaxInflatedTotal, " bytes in all (record '", record, "' reaches ", inflated,
                  "): refused");
  }
}

}  // namespace shoal::checkpoint::detail
