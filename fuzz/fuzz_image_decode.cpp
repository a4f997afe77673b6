// libFuzzer target: the PNG and JPEG decoders (libpng and libjpeg-turbo behind Shoal's error
// handlers) on arbitrary bytes. Every input must end in an image or a DataError, within bounded
// memory (dimensions are checked before the pixels are allocated).
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <string>

#include "shoal/data/image_folder.h"
#include "shoal/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const int fd = ::memfd_create("image", 0);
  static const std::string path = "/proc/self/fd/" + std::to_string(fd);
  if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, data, size, 0) != static_cast<ssize_t>(size)) return 0;
  try {
    shoal::data::decode_image(path);
  } catch (const shoal::DataError&) {
  }
  return 0;
}
