// libFuzzer target: the IDX reader (gzipped or plain) on arbitrary bytes. Every input must end in
// a tensor or a DataError, within bounded memory (the reader never inflates beyond the header).
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <string>

#include "data/idx_file.h"
#include "shoal/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const int fd = ::memfd_create("idx", 0);
  static const std::string path = "/proc/self/fd/" + std::to_string(fd);
  if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, data, size, 0) != static_cast<ssize_t>(size)) return 0;
  try {
    shoal::data::detail::read_idx_images(path, 28, 28, 64.0);
  } catch (const shoal::DataError&) {
  }
  try {
    shoal::data::detail::read_idx_labels(path, 10, 64.0);
  } catch (const shoal::DataError&) {
  }
  return 0;
}
