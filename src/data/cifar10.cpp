#include "shoal/data/cifar10.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <ATen/ATen.h>

#include <cerrno>
#include <cstring>

#include "data/regular_file.h"
#include "shoal/error.h"

namespace shoal::data {
namespace {

constexpr int64_t kImageBytes = Cifar10::kRecordBytes - 1;

bool is_file(const std::string& path) {
  struct stat info {};
  return ::stat(path.c_str(), &info) == 0 && S_ISREG(info.st_mode);
}

/// Reads exactly `size` bytes at `offset`, retrying short reads; throws DataError naming `path`.
void read_at(int fd, const std::string& path, void* out, int64_t size, int64_t offset) {
  auto* bytes = static_cast<char*>(out);
  int64_t done = 0;
  while (done < size) {
    const ssize_t got = ::pread(fd, bytes + done, static_cast<size_t>(size - done),
                                static_cast<off_t>(offset + done));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) SHOAL_THROW(DataError, path, ": read failed at byte ", offset + done, ": ", std::strerror(errno));
    if (got == 0) {
      SHOAL_THROW(DataError, path, ": ends at byte ", offset + done, " inside a record (the file "
                  "shrank while it was read?)");
    }
    done += got;
  }
}

/// uint8 images [B, 3, 32, 32] -> normalised float32.
at::Tensor normalise(const at::Tensor& raw) {
  static const at::Tensor mean =
      at::tensor(std::vector<double>(Cifar10::kMean, Cifar10::kMean + 3), at::kDouble)
          .to(at::kFloat)
          .view({1, 3, 1, 1});
  static const at::Tensor std =
      at::tensor(std::vector<double>(Cifar10::kStd, Cifar10::kStd + 3), at::kDouble)
          .to(at::kFloat)
          .view({1, 3, 1, 1});
  return raw.to(at::kFloat).div_(255.0).sub_(mean).div_(std);
}

}  // namespace

std::vector<std::string> Cifar10::files(const std::string& root, bool train) {
  if (!train) return {root + "/test_batch.bin"};
  std::vector<std::string> paths;
  for (int k = 1; k <= kMaxFiles; ++k) {
    const std::string path = root + "/data_batch_" + std::to_string(k) + ".bin";
    if (!is_file(path)) break;
    paths.push_back(path);
  }
  return paths;
}

bool Cifar10::present(const std::string& root) {
  return is_file(root + "/data_batch_1.bin") || is_file(root + "/test_batch.bin");
}

Cifar10::Cifar10(const std::string& root, bool train, bool in_memory) {
  const std::vector<std::string> paths = files(root, train);
  SHOAL_CHECK_T(DataError, !paths.empty(), root, ": no CIFAR-10 training files (data_batch_1.bin, "
                "data_batch_2.bin, ... of the binary version)");
  int64_t total = 0;
  std::vector<uint8_t> labels;
  try {
    for (const std::string& path : paths) {
      File file;
      file.path = path;
      detail::require_regular_file<DataError>(path);
      file.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
      if (file.fd < 0) {
        SHOAL_THROW(DataError, path, ": cannot open (", std::strerror(errno),
                    "); CIFAR-10 binary files are data_batch_<k>.bin and test_batch.bin");
      }
      files_.push_back(file);
      struct stat info {};
      SHOAL_CHECK_T(DataError, ::fstat(file.fd, &info) == 0, path, ": cannot stat: ", std::strerror(errno));
      const auto bytes = static_cast<int64_t>(info.st_size);
      SHOAL_CHECK_T(DataError, bytes > 0, path, ": is empty");
      SHOAL_CHECK_T(DataError, bytes % kRecordBytes == 0, path, ": ", bytes,
                    " bytes is not a whole number of ", kRecordBytes, "-byte records (record ",
                    bytes / kRecordBytes, " is cut short after ", bytes % kRecordBytes,
                    " bytes): the file is truncated or not CIFAR-10's binary version");
      files_.back().first = total;
      files_.back().records = bytes / kRecordBytes;
      total += files_.back().records;
      // The labels: one byte at the start of every record, read in chunks of whole records.
      constexpr int64_t kChunkRecords = 1024;
      std::vector<uint8_t> chunk;
      for (int64_t r = 0; r < files_.back().records; r += kChunkRecords) {
        const int64_t count = std::min(kChunkRecords, files_.back().records - r);
        chunk.resize(static_cast<size_t>(count * kRecordBytes));
        read_at(file.fd, path, chunk.data(), count * kRecordBytes, r * kRecordBytes);
        for (int64_t i = 0; i < count; ++i) {
          const uint8_t label = chunk[static_cast<size_t>(i * kRecordBytes)];
          SHOAL_CHECK_T(DataError, label < kNumClasses, path, ": record ", r + i, " has label ",
                        static_cast<int>(label), ", outside 0-", kNumClasses - 1,
                        ": not CIFAR-10 (CIFAR-100's binary files have two label bytes)");
          labels.push_back(label);
        }
      }
    }
  } catch (...) {
    for (const File& file : files_) ::close(file.fd);
    files_.clear();
    throw;
  }
  targets_ = at::from_blob(labels.data(), {total}, at::kByte).to(at::kLong);
  if (in_memory) {
    images_ = at::empty({total, kChannels, kRows, kCols}, at::kByte);
    auto* out = images_.data_ptr<uint8_t>();
    std::vector<uint8_t> record(static_cast<size_t>(kRecordBytes));
    for (const File& file : files_) {
      for (int64_t r = 0; r < file.records; ++r) {
        read_at(file.fd, file.path, out + (file.first + r) * kImageBytes, kImageBytes,
                r * kRecordBytes + 1);
      }
    }
  }
}

Cifar10::~Cifar10() {
  for (const File& file : files_) ::close(file.fd);
}

Batch Cifar10::get_batch(const at::Tensor& indices) const {
  const at::Tensor index = indices.to(at::kLong).contiguous();
  const int64_t n = size();
  const int64_t* idx = index.data_ptr<int64_t>();
  for (int64_t i = 0; i < index.numel(); ++i) {
    SHOAL_CHECK_T(InvalidArgument, idx[i] >= 0 && idx[i] < n, "Cifar10::get_batch: index ", idx[i],
                  " is out of range for ", n, " samples");
  }
  at::Tensor raw;
  if (images_.defined()) {
    raw = images_.index_select(0, index);
  } else {
    raw = at::empty({index.numel(), kChannels, kRows, kCols}, at::kByte);
    auto* out = raw.data_ptr<uint8_t>();
    for (int64_t i = 0; i < index.numel(); ++i) {
      // The file holding sample idx[i]: few files, so a linear walk.
      const File* file = &files_.front();
      for (const File& f : files_) {
        if (idx[i] >= f.first) file = &f;
      }
      read_at(file->fd, file->path, out + i * kImageBytes, kImageBytes,
              (idx[i] - file->first) * kRecordBytes + 1);
    }
  }
  return {normalise(raw), targets_.index_select(0, index)};
}

}  // namespace shoal::data
