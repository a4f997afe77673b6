#include "compat/torch_archive.h"

#include <caffe2/serialize/inline_container.h>
#include <caffe2/serialize/read_adapter_interface.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

namespace shoal::compat {
namespace {

// The bytes [offset, offset + length) of a file, as PyTorchStreamReader reads them.
class FileWindow : public caffe2::serialize::ReadAdapterInterface {
 public:
  FileWindow(const std::string& path, uint64_t offset, uint64_t length)
      : fd_(::open(path.c_str(), O_RDONLY | O_CLOEXEC)), offset_(offset), length_(length) {
    TORCH_CHECK(fd_ >= 0, "cannot open ", path);
  }
  ~FileWindow() override { ::close(fd_); }
  FileWindow(const FileWindow&) = delete;
  FileWindow& operator=(const FileWindow&) = delete;

  size_t size() const override { return length_; }
  size_t read(uint64_t pos, void* buf, size_t n, const char* what) const override {
    if (pos >= length_) return 0;
    n = std::min<uint64_t>(n, length_ - pos);
    size_t done = 0;
    while (done < n) {
      const ssize_t got = ::pread(fd_, static_cast<char*>(buf) + done, n - done,
                                  static_cast<off_t>(offset_ + pos + done));
      if (got < 0 && errno == EINTR) continue;
      TORCH_CHECK(got > 0, "cannot read ", what, " (", n, " bytes at ", pos, ")");
      done += static_cast<size_t>(got);
    }
    return done;
  }

 private:
  int fd_;
  uint64_t offset_;
  uint64_t length_;
};

}  // namespace

TorchArchiveReader::TorchArchiveReader(const std::string& path)
    : reader_(std::make_unique<caffe2::serialize::PyTorchStreamReader>(path)) {}

TorchArchiveReader::TorchArchiveReader(const std::string& path, uint64_t offset, uint64_t length)
    : reader_(std::make_unique<caffe2::serialize::PyTorchStreamReader>(
          std::make_shared<FileWindow>(path, offset, length))) {}

TorchArchiveReader::~TorchArchiveReader() = default;

bool TorchArchiveReader::has_record(const std::string& name) const {
  return reader_->hasRecord(name);
}

std::vector<std::string> TorchArchiveReader::records() const { return reader_->getAllRecords(); }

std::string TorchArchiveReader::read(const std::string& name) const {
  auto [data, size] = reader_->getRecord(name);
  return std::string(static_cast<const char*>(data.get()), size);
}

TorchArchiveWriter::TorchArchiveWriter(Sink sink)
    : writer_(std::make_unique<caffe2::serialize::PyTorchStreamWriter>(std::move(sink))) {}

TorchArchiveWriter::~TorchArchiveWriter() = default;

void TorchArchiveWriter::write(const std::string& name, const void* data, size_t size) {
  writer_->writeRecord(name, data, size);
}

void TorchArchiveWriter::finish() { writer_->writeEndOfFile(); }

}  // namespace shoal::compat
