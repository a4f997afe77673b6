// DCP's `.metadata` pickle for any set of entries (tensors in chunks from any number of rank files,
// and bytes entries), shared by save_dcp (one process) and the sharded checkpoints of FSDP (each
// rank's chunks, gathered by rank 0).
//
// Thread safety: plain values and functions.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>
#include <variant>
#include <vector>

namespace shoal::checkpoint::detail {

/// A chunk of a tensor (offsets and sizes per dimension; none for a bytes entry) and where its
/// torch.save bytes lie.
struct DcpChunk {
  std::vector<int64_t> offsets;
  std::vector<int64_t> sizes;
  std::string file;  ///< relative to the folder: "__<rank>_0.distcp"
  int64_t offset = 0;
  int64_t length = 0;
};

/// One key of the flattened state dict.
struct DcpEntry {
  std::string fqn;  ///< the flattened key: "model.fc1.weight"
  /// The key's place in the nested dict dcp.save flattened (DCP's planner_data): strings and
  /// list indices, e.g. {"optim", "param_groups", 0, "lr"}.
  std::vector<std::variant<std::string, int64_t>> path;
  bool bytes = false;  ///< a pickled object (BytesStorageMetadata), one chunk without offsets
  c10::ScalarType dtype = c10::ScalarType::Float;
  std::vector<int64_t> size;
  std::vector<DcpChunk> chunks;
};

/// The `.metadata` file's bytes for `entries`, as dcp.save writes them.
std::string dcp_metadata_pickle(const std::vector<DcpEntry>& entries);

/// Makes `folder` (one level), or accepts it when it exists and is empty; throws CheckpointError
/// naming it otherwise.
void make_empty_folder(const std::string& folder);

}  // namespace shoal::checkpoint::detail
