// Reading a torch.save archive that lies inside a larger file (each tensor of a DCP data file).
//
// Thread safety: reentrant.
#pragma once

#include <ATen/core/ivalue.h>

#include <cstdint>
#include <string>

#include "shoal/checkpoint/serialization.h"

namespace shoal::checkpoint::detail {

/// load() of the torch.save archive at [offset, offset + length) in `path`, with every check
/// load() makes; errors name "path (bytes offset+length)". The caller checks that the range lies
/// inside the file.
c10::IValue load_torch_save_blob(const std::string& path, uint64_t offset, uint64_t length,
                                 const LoadOptions& options);

}  // namespace shoal::checkpoint::detail
