// libFuzzer target: a checkpoint's checksum manifest parser on arbitrary text. Every input must
// be read or refused with CheckpointError (never std::invalid_argument / out_of_range from the
// number conversions, never a manifest that reads as empty).
#include <cstdint>
#include <string>

#include "checkpoint/checksum_manifest.h"
#include "shoal/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    const auto checksums = shoal::checkpoint::detail::parse_checksum_manifest(text, "fuzz");
    if (checksums.empty()) __builtin_trap();
    for (const auto& [name, sum] : checksums) {
      // A line that was accepted is written back the same way by the writer.
      const std::string line = shoal::checkpoint::detail::manifest_line(name, sum.size, sum.crc);
      if (line.empty() || name.empty()) __builtin_trap();
    }
  } catch (const shoal::CheckpointError&) {
  }
  return 0;
}
