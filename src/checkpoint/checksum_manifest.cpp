#include "checkpoint/checksum_manifest.h"

#include <zlib.h>

#include <algorithm>
#include <cstdio>
#include <sstream>

#include "shoal/error.h"

namespace shoal::checkpoint::detail {

uint32_t crc32_of(const void* data, size_t size) {
  // zlib's crc32 takes a 32-bit length: feed large records in 1 GiB pieces.
  constexpr size_t kPiece = size_t{1} << 30;
  uLong crc = ::crc32(0L, Z_NULL, 0);
  const auto* p = static_cast<const Bytef*>(data);
  while (size > 0) {
    const size_t n = std::min(size, kPiece);
    crc = ::crc32(crc, p, static_cast<uInt>(n));
    p += n;
    size -= n;
  }
  return static_cast<uint32_t>(crc);
}

std::string manifest_line(const std::string& name, uint64_t size, uint32_t crc) {
  char hex[16];
  std::snprintf(hex, sizeof(hex), "%08x", crc);
  return name + " " + std::to_string(size) + " " + hex + "\n";
}

std::map<std::string, Checksum> parse_checksum_manifest(const std::string& text,
                                                        const std::string& where) {
  std::map<std::string, Checksum> checksums;
  std::istringstream lines(text);
  std::string line;
  size_t number = 0;
  while (std::getline(lines, line)) {
    ++number;
    std::istringstream fields(line);
    std::string name, size, crc, rest;
    fields >> name >> size >> crc;
    // 19 digits always fit in 64 bits, so std::stoull below cannot throw out_of_range.
    const bool ok = !name.empty() && !size.empty() && size.size() <= 19 && crc.size() == 8 &&
                    size.find_first_not_of("0123456789") == std::string::npos &&
                    crc.find_first_not_of("0123456789abcdef") == std::string::npos &&
                    !(fields >> rest);
    SHOAL_CHECK_T(CheckpointError, ok, where, ": the checksum manifest (record '",
                  kChecksumRecord, "') is unreadable at line ", number, ": the file is corrupt");
    checksums[name] = Checksum{std::stoull(size), static_cast<uint32_t>(std::stoul(crc, nullptr, 16))};
  }
  SHOAL_CHECK_T(CheckpointError, !checksums.empty(), where, ": the checksum manifest (record '",
                kChecksumRecord, "') is empty: the file is corrupt");
  return checksums;
}

}  // namespace shoal::checkpoint::detail
