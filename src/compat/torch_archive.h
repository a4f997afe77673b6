// PyTorch's zip container (the format of torch.save since 1.6), read and written through LibTorch's
// caffe2::serialize::PyTorchStreamReader/Writer, whose headers and behaviour are version-specific.
//
// Records are named without the archive folder ("data.pkl", "data/0", "version"); the writer puts
// them under "archive/", as Python's torch.save does in 2.x. Errors surface as c10::Error; callers
// in checkpoint/ turn them into CheckpointError naming the file.
//
// Thread safety: one object per thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace caffe2::serialize {
class PyTorchStreamReader;
class PyTorchStreamWriter;
}  // namespace caffe2::serialize

namespace shoal::compat {

/// Reads the records of a torch.save zip archive.
class TorchArchiveReader {
 public:
  /// Opens `path`; throws c10::Error when it is not a readable zip archive.
  explicit TorchArchiveReader(const std::string& path);
  /// Opens the archive that lies at [offset, offset + length) in `path` (which must hold it).
  TorchArchiveReader(const std::string& path, uint64_t offset, uint64_t length);
  ~TorchArchiveReader();

  bool has_record(const std::string& name) const;
  /// Record names without the archive folder.
  std::vector<std::string> records() const;
  /// The record's bytes.
  std::string read(const std::string& name) const;

 private:
  std::unique_ptr<caffe2::serialize::PyTorchStreamReader> reader_;
};

/// Writes a torch.save zip archive through `sink` (which returns the bytes it took; fewer means
/// failure, and the writer then throws c10::Error).
class TorchArchiveWriter {
 public:
  using Sink = std::function<size_t(const void* data, size_t size)>;
  explicit TorchArchiveWriter(Sink sink);
  ~TorchArchiveWriter();

  void write(const std::string& name, const void* data, size_t size);
  /// Writes the "version" record and the zip's central directory.
  void finish();

 private:
  std::unique_ptr<caffe2::serialize::PyTorchStreamWriter> writer_;
};

}  // namespace shoal::compat
