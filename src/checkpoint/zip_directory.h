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
  /// The directory of the archive that lies at [offset, offset + length) in `path` (a blob of a
  /// DCP data file); offsets in it count from `offset`, file_size() is its length (as far as
  /// the file holds).
  ZipDirectory(const std::string& path, uint64_t offset, uint64_t length);

  const std::vector<Entry>& entries() const { return entries_; }
  uint64_t file_size() const { return file_size_; }

 private:
  std::vector<Entry> entries_;
  uint64_t file_size_ = 0;
};

/// Largest size one deflated record (a pickle, TorchScript code) may inflate to, and all of them
/// together. torch.save and torch.jit.save store tensors uncompressed; the rest of a checkpoint
/// is a pickle of a few MB, and a TorchScript model's code and debug records a few MB more.
constexpr uint64_t kMaxInflatedRecord = uint64_t{64} << 20;
constexpr uint64_t kMaxInflatedTotal = uint64_t{256} << 20;

/// Judges every record of `directory` (the file `path`) by what it declares, before anything is
/// inflated: tensor records (under data/ or constants/) must be stored, as torch.save and
/// torch.jit.save write them; other records may be deflated within kMaxInflatedRecord each and
/// kMaxInflatedTotal in all. So a small file cannot make a reader allocate gigabytes. Throws
/// CheckpointError naming the file and the record.
void check_declared_sizes(const ZipDirectory& directory, const std::string& path);

/// The record's name without the archive folder ("archive/data/0" -> "data/0").
std::string record_name(const ZipDirectory::Entry& entry);

}  // namespace shoal::checkpoint::detail
