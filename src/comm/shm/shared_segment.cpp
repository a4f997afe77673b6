#include "comm/shm/shared_segment.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

#include "shoal/error.h"

namespace shoal::comm::shm {
namespace {

void* map(int fd, size_t bytes, const std::string& name) {
  void* data = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  const int err = errno;
  SHOAL_CHECK(data != MAP_FAILED, "shm: cannot map segment ", name, " (", bytes,
              " bytes): ", std::strerror(err));
  return data;
}

constexpr const char* kShmDir = "/dev/shm";
constexpr const char* kNamePrefix = "shoal-";

/// Calls `fn(file name, creator pid)` for each Shoal segment name in /dev/shm.
template <typename Fn>
void for_each_segment(Fn fn) {
  DIR* dir = ::opendir(kShmDir);
  if (dir == nullptr) return;
  std::vector<std::pair<std::string, int>> found;
  while (dirent* entry = ::readdir(dir)) {
    const std::string name = entry->d_name;
    if (name.rfind(kNamePrefix, 0) != 0) continue;
    char* end = nullptr;
    const long pid = std::strtol(name.c_str() + std::strlen(kNamePrefix), &end, 10);
    if (end == nullptr || *end != '-' || pid <= 0) continue;
    found.emplace_back(name, static_cast<int>(pid));
  }
  ::closedir(dir);
  for (const auto& [name, pid] : found) fn(name, pid);
}

}  // namespace

int SharedSegment::remove_segments_of(const std::vector<int>& pids) {
  int removed = 0;
  for_each_segment([&](const std::string& name, int pid) {
    if (std::find(pids.begin(), pids.end(), pid) != pids.end() && shm_unlink(("/" + name).c_str()) == 0) ++removed;
  });
  return removed;
}

int SharedSegment::reclaim_dead_segments() {
  int removed = 0;
  for_each_segment([&](const std::string& name, int pid) {
    // ESRCH only: a live process (or one of another user, EPERM) keeps its names.
    if (::kill(pid, 0) != 0 && errno == ESRCH && shm_unlink(("/" + name).c_str()) == 0) ++removed;
  });
  return removed;
}

SharedSegment SharedSegment::create(const std::string& name, size_t bytes) {
  reclaim_dead_segments();
  const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  SHOAL_CHECK(fd >= 0, "shm: cannot create segment ", name, " in /dev/shm: ",
              std::strerror(errno));
  SharedSegment segment;
  segment.name_ = name;
  segment.owner_ = true;
  const int err = posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  if (err != 0) {
    close(fd);
    shm_unlink(name.c_str());
    SHOAL_THROW(Error, "shm: cannot size segment ", name, " to ", bytes, " bytes: ",
                std::strerror(err), err == ENOSPC ? " (/dev/shm is full or too small; "
                                                    "free it or mount it larger)" : "");
  }
  try {
    segment.data_ = map(fd, bytes, name);
  } catch (...) {
    close(fd);
    shm_unlink(name.c_str());
    throw;
  }
  close(fd);
  segment.size_ = bytes;
  return segment;
}

SharedSegment SharedSegment::open(const std::string& name, size_t bytes) {
  const int fd = shm_open(name.c_str(), O_RDWR, 0600);
  SHOAL_CHECK(fd >= 0, "shm: cannot open segment ", name, ": ", std::strerror(errno),
              " (are all ranks on one host? use the hierarchical backend across hosts)");
  struct stat st {};
  if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) != bytes) {
    close(fd);
    SHOAL_THROW(Error, "shm: segment ", name, " has ", st.st_size, " bytes, expected ", bytes,
                "; were all ranks started with the same Shoal build and settings?");
  }
  SharedSegment segment;
  segment.name_ = name;
  try {
    segment.data_ = map(fd, bytes, name);
  } catch (...) {
    close(fd);
    throw;
  }
  close(fd);
  segment.size_ = bytes;
  return segment;
}

SharedSegment::SharedSegment(SharedSegment&& other) noexcept { *this = std::move(other); }

SharedSegment& SharedSegment::operator=(SharedSegment&& other) noexcept {
  if (this != &other) {
    release();
    name_ = std::move(other.name_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    owner_ = std::exchange(other.owner_, false);
    unlinked_ = std::exchange(other.unlinked_, false);
  }
  return *this;
}

SharedSegment::~SharedSegment() { release(); }

void SharedSegment::unlink() {
  if (unlinked_ || name_.empty()) return;
  unlinked_ = true;
  shm_unlink(name_.c_str());  // ENOENT: another rank removed it first
}

void SharedSegment::release() {
  if (owner_) unlink();
  if (data_ != nullptr) munmap(data_, size_);
  data_ = nullptr;
  size_ = 0;
}

}  // namespace shoal::comm::shm
