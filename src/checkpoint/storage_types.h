// The storage classes torch.save names in its pickles ("torch.FloatStorage"), and their dtypes.
//
// Thread safety: pure functions.
#pragma once

#include <c10/core/ScalarType.h>

#include <optional>
#include <string>

namespace shoal::checkpoint::detail {

/// "FloatStorage" for float32; throws CheckpointError for a dtype torch.save cannot name.
std::string storage_type_name(c10::ScalarType dtype);

/// The dtype of a storage class given by its full name ("torch.FloatStorage",
/// "torch.storage.UntypedStorage" = uint8), or nullopt when it is not a storage class.
std::optional<c10::ScalarType> storage_dtype(const std::string& qualified_name);

/// The dtype Python names `qualified_name` ("torch.float32"), or nullopt when it names none of
/// the dtypes torch.save can store.
std::optional<c10::ScalarType> torch_dtype(const std::string& qualified_name);

}  // namespace shoal::checkpoint::detail
