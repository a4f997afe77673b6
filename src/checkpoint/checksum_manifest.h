// The checksum manifest of a Shoal checkpoint: the record "shoal_checksum", one line
// "<name> <size> <crc32 as 8 hex digits>" per other record. torch.load ignores records it does not
// know, and LibTorch's zip reader does not check the zip's own CRCs, so this is what catches a
// damaged tensor.
//
// Parsing is all or nothing: a line that does not read as above means the file is damaged, and
// loading without the checks would hide exactly that.
//
// Thread safety: pure functions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>

namespace shoal::checkpoint::detail {

/// The record's name.
constexpr const char* kChecksumRecord = "shoal_checksum";

struct Checksum {
  uint64_t size = 0;
  uint32_t crc = 0;
};

/// zlib's CRC-32 of `size` bytes (any size: fed to zlib in 1 GiB pieces).
uint32_t crc32_of(const void* data, size_t size);

/// One manifest line for a record, "data/0 4096 1a2b3c4d\n".
std::string manifest_line(const std::string& name, uint64_t size, uint32_t crc);

/// The checksums a manifest lists, by record name. Throws CheckpointError naming `where` and the
/// first unreadable line, or saying the manifest is empty.
std::map<std::string, Checksum> parse_checksum_manifest(const std::string& text,
                                                        const std::string& where);

}  // namespace shoal::checkpoint::detail
