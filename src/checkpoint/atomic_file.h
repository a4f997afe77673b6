// AtomicFile: writes a file so that a crash at any moment leaves either the previous file or the
// complete new one. Data goes to "<dir>/.<name>.tmp.<pid>" in the same folder (so rename stays on
// one filesystem); commit() fsyncs it, renames it over the target and fsyncs the folder so the
// rename itself survives a power loss. Without commit() the temporary file is removed.
//
// Thread safety: one object per thread.
#pragma once

#include <cstddef>
#include <string>

namespace shoal::checkpoint::detail {

class AtomicFile {
 public:
  /// Creates the temporary file; throws CheckpointError when the folder is not writable.
  explicit AtomicFile(std::string path);
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  /// Appends bytes; never throws. The first failure is remembered and reported by commit().
  size_t append(const void* data, size_t size) noexcept;
  /// Makes the file visible under its name; throws CheckpointError on any earlier or new failure.
  void commit();

  const std::string& temporary_path() const { return temporary_; }

 private:
  std::string path_;
  std::string temporary_;
  int fd_ = -1;
  int error_ = 0;          // errno of the first failed write
  bool committed_ = false;
};

/// Writes `content` to `path` through an AtomicFile.
void write_file_atomically(const std::string& path, const std::string& content);

/// The folder part of `path` ("." when there is none).
std::string parent_directory(const std::string& path);

/// Deletes `path` and, when it is a folder, everything under it, without following symbolic
/// links; what cannot be deleted stays. (Not std::filesystem::remove_all: PyTorch's libtorch_cpu
/// exports a copy of libstdc++'s filesystem functions that interposes the real ones, and
/// 2.11.0's remove_all jumped to address 0 on a GPU machine.)
void remove_tree(const std::string& path);

}  // namespace shoal::checkpoint::detail
