#include "checkpoint/atomic_file.h"

#include <fcntl.h>
#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "shoal/error.h"

namespace shoal::checkpoint::detail {
namespace {

std::string base_name(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

}  // namespace

namespace {
int remove_entry(const char* path, const struct stat*, int, struct FTW*) {
  ::remove(path);  // a file, a link, or a folder already emptied (FTW_DEPTH: children first)
  return 0;
}
}  // namespace

void remove_tree(const std::string& path) {
  ::nftw(path.c_str(), remove_entry, 16, FTW_DEPTH | FTW_PHYS);
}

std::string parent_directory(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

AtomicFile::AtomicFile(std::string path) : path_(std::move(path)) {
  const std::string dir = parent_directory(path_);
  temporary_ = dir + "/." + base_name(path_) + ".tmp." + std::to_string(::getpid());
  fd_ = ::open(temporary_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  SHOAL_CHECK_T(CheckpointError, fd_ >= 0, "cannot write ", path_, ": creating ", temporary_,
                " failed: ", std::strerror(errno), " (does the folder exist and is it writable?)");
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_) ::unlink(temporary_.c_str());
}

size_t AtomicFile::append(const void* data, size_t size) noexcept {
  if (error_ != 0) return size;
  const char* p = static_cast<const char*>(data);
  size_t left = size;
  while (left > 0) {
    const ssize_t n = ::write(fd_, p, left);
    if (n < 0) {
      if (errno == EINTR) continue;
      error_ = errno;
      break;
    }
    p += n;
    left -= static_cast<size_t>(n);
  }
  // Report everything as taken: the archive writer must not fail half-way (its destructor would
  // throw); commit() reports the error instead.
  return size;
}

void AtomicFile::commit() {
  SHOAL_CHECK_T(CheckpointError, error_ == 0, "cannot write ", path_, ": writing ", temporary_,
                " failed: ", std::strerror(error_), "; the previous file, if any, is unchanged");
  SHOAL_CHECK_T(CheckpointError, ::fsync(fd_) == 0, "cannot write ", path_, ": fsync of ",
                temporary_, " failed: ", std::strerror(errno));
  ::close(fd_);
  fd_ = -1;
  SHOAL_CHECK_T(CheckpointError, ::rename(temporary_.c_str(), path_.c_str()) == 0, "cannot write ",
                path_, ": renaming ", temporary_, " failed: ", std::strerror(errno));
  committed_ = true;
  // The rename is only durable once the folder's entry is on disk.
  const int dir = ::open(parent_directory(path_).c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir >= 0) {
    ::fsync(dir);
    ::close(dir);
  }
}

void write_file_atomically(const std::string& path, const std::string& content) {
  AtomicFile file(path);
  file.append(content.data(), content.size());
  file.commit();
}

}  // namespace shoal::checkpoint::detail
