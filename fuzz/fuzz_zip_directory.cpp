// libFuzzer target: the zip directory reader that judges a checkpoint's records before LibTorch
// inflates any of them. Every input must be read or refused with CheckpointError.
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <string>

#include "checkpoint/zip_directory.h"
#include "shoal/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const int fd = ::memfd_create("zip", 0);
  static const std::string path = "/proc/self/fd/" + std::to_string(fd);
  if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, data, size, 0) != static_cast<ssize_t>(size)) return 0;
  try {
    shoal::checkpoint::detail::ZipDirectory directory(path);
    for (const auto& e : directory.entries()) {
      if (e.local_header_offset + e.compressed_size > directory.file_size()) __builtin_trap();
    }
  } catch (const shoal::CheckpointError&) {
  }
  return 0;
}
