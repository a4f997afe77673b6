// SharedSegment: a POSIX shared-memory segment (shm_open + mmap) mapped into this process.
//
// The creator sizes it (posix_fallocate, so a full /dev/shm is an error now rather than a SIGBUS
// later) and every user maps it with MAP_POPULATE, so no operation ever takes a page fault on it.
// unlink() removes the name as soon as every rank has mapped it: the memory then lives exactly as
// long as the mappings, and a job killed with SIGKILL leaves nothing behind in /dev/shm.
// Before that moment (the creator made the name, not every rank has mapped it) a SIGKILL would
// leave the name behind: names carry the creator's pid ("/shoal-<pid>-<random>"), so `shoal run`
// removes those of its workers once they have ended (remove_segments_of), and every new segment
// first removes those whose creator is dead (reclaim_dead_segments) for jobs started otherwise.
//
// Thread safety: none needed; constructed and destroyed by one thread, the memory itself is
// synchronised by its users.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace shoal::comm::shm {

class SharedSegment {
 public:
  /// Creates (exclusively) and maps `name` of `bytes` bytes, zero-filled.
  static SharedSegment create(const std::string& name, size_t bytes);
  /// Maps an existing segment; checks that it has `bytes` bytes.
  static SharedSegment open(const std::string& name, size_t bytes);

  SharedSegment() = default;
  SharedSegment(SharedSegment&& other) noexcept;
  SharedSegment& operator=(SharedSegment&& other) noexcept;
  SharedSegment(const SharedSegment&) = delete;
  SharedSegment& operator=(const SharedSegment&) = delete;
  /// Unmaps; removes the name too when this process created it and it is still there.
  ~SharedSegment();

  /// Removes the name (idempotent); the mappings stay valid.
  void unlink();

  /// Removes every "/dev/shm/shoal-<pid>-*" of the given (ended) processes; returns how many.
  static int remove_segments_of(const std::vector<int>& pids);
  /// Removes every "/dev/shm/shoal-<pid>-*" whose creator no longer exists; returns how many.
  static int reclaim_dead_segments();

  void* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& name() const { return name_; }

 private:
  void release();

  std::string name_;
  void* data_ = nullptr;
  size_t size_ = 0;
  bool owner_ = false;
  bool unlinked_ = false;
};

}  // namespace shoal::comm::shm
