// ZipDirectory: the central directory of a zip archive (the container of torch.save files), read
// with every offset and size checked against the file, so that a checkpoint's records can be
// judged by what they declare before LibTorch's reader inflates any of them.
//
// Only what the checks need is kept: each record's name, compression method and sizes. Zip64
// archives (files over 4 GiB, which torch.save writes for large models) are understood.
//
// Thread safety: immutable after construction.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace shoal::checkpoint::detail {

class ZipDirectory {
 public:
  struct Entry {
    std::string name;            // as stored, with the archive folder ("archive/data.pkl")
    uint16_t method = 0;         // 0 = stored, 8 = deflated
    uint64_t compressed_size = 0;
    uint64_t uncompressed_size = 0;
    uint64_t local_header_offset = 0;
  };

  /// Reads the directory of `path`; throws CheckpointError naming the file when it is not a
  /// well-formed zip directory.
  explicit ZipDirectory(const std::string& path);

  const std::vector<Entry>& entries() const { return entries_; }
  uint64_t file_size() const { return file_size_; }

 private:
  std::vector<Entry> entries_;
  uint64_t file_size_ = 0;
};

}  // namespace shoal::checkpoint::detail
