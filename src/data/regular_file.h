// Every file Shoal reads data from (datasets, tensor files, checkpoints, TorchScript models) is
// checked to be a regular file before it is opened: open() of a FIFO waits for a writer that may
// never come, and a device or socket may never end. One rule, one place, one message.
//
// Thread safety: a free function with no shared state.
#pragma once

#include <sys/stat.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>

#include "shoal/error.h"

namespace shoal::data::detail {

/// What a file that is not regular is, for the message.
inline const char* file_kind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  return "not a regular file";
}

/// The size of `path` when it is a regular file (symbolic links followed); throws `E` naming the
/// file otherwise (missing, unreadable, a directory, a FIFO, a device), without opening it.
template <typename E>
uint64_t require_regular_file(const std::string& path) {
  struct stat info {};
  if (::stat(path.c_str(), &info) != 0) {
    const int err = errno;
    if (err == ENOENT) SHOAL_THROW(E, path, ": cannot open: file not found");
    SHOAL_THROW(E, path, ": cannot open: ", std::strerror(err));
  }
  SHOAL_CHECK_T(E, S_ISREG(info.st_mode), path, ": is ", file_kind(info.st_mode),
                ", not a regular file; give the path of a file");
  return static_cast<uint64_t>(info.st_size);
}

}  // namespace shoal::data::detail
