#include <sys/stat.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <tuple>
#include <utility>
#include <vector>

#include "checkpoint/storage_types.h"
#include "checkpoint/torch_save_reader.h"
#include "checkpoint/unpickler.h"
#include "data/regular_file.h"
#include "shoal/checkpoint/dcp.h"
#include "shoal/error.h"

namespace shoal::checkpoint {
namespace {

using detail::Unpickler;

constexpr const char* kClassPrefix = "torch.distributed.checkpoint.metadata.";

struct Chunk {
  std::vector<int64_t> offsets;
  std::vector<int64_t> sizes;
  int64_t numel = 1;
};

struct TensorEntry {
  std::string fqn;
  c10::ScalarType dtype = c10::ScalarType::Float;
  std::vector<int64_t> size;
  std::vector<Chunk> chunks;
};

// Where one chunk's torch.save bytes lie.
struct StorageInfo {
  std::string file;  // relative to the folder
  int64_t offset = 0;
  int64_t length = 0;
};

using ChunkKey = std::pair<std::string, std::vector<int64_t>>;  // DCP's MetadataIndex: fqn, offsets

// What `.metadata` says, checked for shape (not yet against the data files).
struct Metadata {
  std::vector<TensorEntry> tensors;  // in file order
  std::vector<std::string> bytes;    // non-tensor entries
  std::map<ChunkKey, StorageInfo> storage;
  std::map<std::string, StorageInfo> byte_storage;  // bytes entries' pickles, by name
};

// Reads the plain data the unpickler built from `.metadata` (see UnpicklerLimits::dcp_metadata),
// naming the file in every error.
class MetadataReader {
 public:
  explicit MetadataReader(std::string where) : where_(std::move(where)) {}

  Metadata read(const c10::IValue& root) const {
    expect_class(root, "Metadata", "the checkpoint");
    Metadata out;
    for (const auto& item : dict(field(root, "state_dict_metadata"), "state_dict_metadata")) {
      const std::string fqn = text(item.key(), "a state_dict_metadata key");
      if (class_of(item.value()) == std::string(kClassPrefix) + "BytesStorageMetadata") {
        out.bytes.push_back(fqn);
        continue;
      }
      out.tensors.push_back(tensor(fqn, item.value()));
    }
    for (const auto& item : dict(field(root, "storage_data"), "storage_data")) {
      auto [key, info, bytes] = storage(item.value());
      const std::string fqn = key.first;
      const bool added = bytes ? out.byte_storage.emplace(fqn, std::move(info)).second
                               : out.storage.emplace(std::move(key), std::move(info)).second;
      check(added, "names the bytes of one chunk of '", fqn, "' twice in storage_data");
    }
    return out;
  }

 private:
  template <typename... Parts>
  void check(bool ok, const Parts&... parts) const {
    SHOAL_CHECK_T(CheckpointError, ok, where_, ": ", parts...,
                  ": not a DCP checkpoint PyTorch's dcp.save wrote, or a damaged one");
  }

  std::string class_of(const c10::IValue& object) const {
    if (!object.isGenericDict()) return "";
    const auto d = object.toGenericDict();
    auto it = d.find(c10::IValue(std::string(Unpickler::kClassKey)));
    return it != d.end() && it->value().isString() ? it->value().toStringRef() : "";
  }

  void expect_class(const c10::IValue& object, const std::string& name, const std::string& what) const {
    const std::string cls = class_of(object);
    check(cls == kClassPrefix + name || (name == "_StorageInfo" &&
                                         cls == "torch.distributed.checkpoint.filesystem._StorageInfo"),
          what, " is a ", cls.empty() ? object.tagKind() : cls, ", not a ", name);
  }

  c10::IValue field(const c10::IValue& object, const std::string& name) const {
    const auto d = object.toGenericDict();
    auto it = d.find(c10::IValue(name));
    check(it != d.end(), "a ", class_of(object), " without its field '", name, "'");
    return it->value();
  }

  c10::impl::GenericDict dict(const c10::IValue& value, const std::string& what) const {
    check(value.isGenericDict(), what, " is not a dict");
    return value.toGenericDict();
  }

  std::string text(const c10::IValue& value, const std::string& what) const {
    check(value.isString(), what, " is not a string");
    return value.toStringRef();
  }

  int64_t integer(const c10::IValue& value, const std::string& what) const {
    check(value.isInt() && value.toInt() >= 0, what, " is not a non-negative integer");
    return value.toInt();
  }

  std::vector<int64_t> ints(const c10::IValue& value, const std::string& what) const {
    check(value.isTuple(), what, " is not a torch.Size");
    std::vector<int64_t> out;
    for (const auto& element : value.toTupleRef().elements()) out.push_back(integer(element, what));
    return out;
  }

  c10::ScalarType dtype(const c10::IValue& properties, const std::string& fqn) const {
    expect_class(properties, "TensorProperties", "the properties of '" + fqn + "'");
    const c10::IValue state = field(properties, "__state__");
    check(state.isTuple() && !state.toTupleRef().elements().empty(), "the properties of '", fqn,
          "' are not DCP's TensorProperties tuple");
    const c10::IValue name = state.toTupleRef().elements()[0];
    const auto type = name.isString() ? detail::torch_dtype(name.toStringRef()) : std::nullopt;
    check(type.has_value(), "'", fqn, "' has a dtype Shoal cannot read");
    return *type;
  }

  TensorEntry tensor(const std::string& fqn, const c10::IValue& value) const {
    expect_class(value, "TensorStorageMetadata", "entry '" + fqn + "'");
    TensorEntry entry;
    entry.fqn = fqn;
    entry.dtype = dtype(field(value, "properties"), fqn);
    entry.size = ints(field(value, "size"), "the size of '" + fqn + "'");
    const c10::IValue chunks = field(value, "chunks");
    check(chunks.isList(), "the chunks of '", fqn, "' are not a list");
    for (const auto& item : chunks.toListRef()) {
      expect_class(item, "ChunkStorageMetadata", "a chunk of '" + fqn + "'");
      Chunk chunk;
      chunk.offsets = ints(field(item, "offsets"), "a chunk offset of '" + fqn + "'");
      chunk.sizes = ints(field(item, "sizes"), "a chunk size of '" + fqn + "'");
      entry.chunks.push_back(std::move(chunk));
    }
    return entry;
  }

  bool has_field(const c10::IValue& object, const std::string& name) const {
    const auto d = object.toGenericDict();
    auto it = d.find(c10::IValue(name));
    return it != d.end() && !it->value().isNone();
  }

  // A chunk's key and where its bytes lie; a bytes entry's (no offset) says so.
  std::tuple<ChunkKey, StorageInfo, bool> storage(const c10::IValue& entry) const {
    // An entry keyed by an object: (MetadataIndex, _StorageInfo), see kObjectKeyPrefix.
    check(entry.isTuple() && entry.toTupleRef().elements().size() == 2,
          "storage_data is not keyed by MetadataIndex");
    const auto& pair = entry.toTupleRef().elements();
    expect_class(pair[0], "MetadataIndex", "a storage_data key");
    expect_class(pair[1], "_StorageInfo", "a storage_data value");
    const bool bytes = !has_field(pair[0], "offset");
    ChunkKey key{text(field(pair[0], "fqn"), "a MetadataIndex fqn"), {}};
    if (!bytes) key.second = ints(field(pair[0], "offset"), "a MetadataIndex offset");
    StorageInfo info;
    info.file = text(field(pair[1], "relative_path"), "a relative_path");
    info.offset = integer(field(pair[1], "offset"), "a storage offset");
    info.length = integer(field(pair[1], "length"), "a storage length");
    check(!info.file.empty() && info.file.find('/') == std::string::npos && info.file != "." &&
              info.file != "..",
          "the data file '", info.file, "' is not a file name in the checkpoint's folder");
    const auto fields = pair[1].toGenericDict();
    auto transforms = fields.find(c10::IValue(std::string("transform_descriptors")));
    check(transforms == fields.end() || transforms->value().isNone() ||
              (transforms->value().isList() && transforms->value().toListRef().empty()),
          "the bytes of '", key.first, "' are transformed (compressed or encrypted by a DCP ",
          "extension), which Shoal does not read; save without transforms");
    return {std::move(key), std::move(info), bytes};
  }

  std::string where_;
};

// Most chunks one tensor may have: one per rank that saved it, and thousands of ranks are far
// below; it bounds the overlap check (quadratic when every chunk spans the first dimension).
constexpr size_t kMaxChunks = size_t{1} << 16;

int64_t element_count(const TensorEntry& entry, const std::string& where) {
  int64_t numel = 1;
  for (int64_t dim : entry.size) {
    SHOAL_CHECK_T(CheckpointError, !__builtin_mul_overflow(numel, dim, &numel), where, ": '",
                  entry.fqn, "' has a size whose element count overflows");
  }
  return numel;
}

// Refuses a chunk that leaves its tensor; sets its element count.
void check_inside(const TensorEntry& entry, Chunk& chunk, const std::string& where) {
  SHOAL_CHECK_T(CheckpointError,
                chunk.offsets.size() == entry.size.size() && chunk.sizes.size() == entry.size.size(), where,
                ": a chunk of '", entry.fqn, "' has ", chunk.sizes.size(), " dimensions, the tensor ",
                entry.size.size());
  for (size_t d = 0; d < entry.size.size(); ++d) {
    SHOAL_CHECK_T(CheckpointError,
                  chunk.offsets[d] <= entry.size[d] && chunk.sizes[d] <= entry.size[d] - chunk.offsets[d], where,
                  ": a chunk of '", entry.fqn, "' lies outside the tensor (dimension ", d, ": offset ",
                  chunk.offsets[d], " size ", chunk.sizes[d], " of ", entry.size[d], ")");
    chunk.numel *= chunk.sizes[d];  // at most the tensor's count, which did not overflow
  }
}

bool overlap(const Chunk& a, const Chunk& b) {
  bool overlap = a.numel > 0 && b.numel > 0;
  for (size_t d = 0; d < a.offsets.size() && overlap; ++d) {
    overlap = a.offsets[d] < b.offsets[d] + b.sizes[d] && b.offsets[d] < a.offsets[d] + a.sizes[d];
  }
  return overlap;
}

// Refuses overlapping chunks. Sorted by their first offset, a chunk can only overlap those that
// start before it ends: slabs along the first dimension (FSDP's shards) cost n log n.
void check_disjoint(const TensorEntry& entry, const std::string& where) {
  std::vector<const Chunk*> sorted;
  for (const auto& chunk : entry.chunks) sorted.push_back(&chunk);
  std::sort(sorted.begin(), sorted.end(), [](const Chunk* a, const Chunk* b) { return a->offsets < b->offsets; });
  for (size_t i = 0; i < sorted.size(); ++i) {
    for (size_t j = i + 1; j < sorted.size(); ++j) {
      const Chunk& a = *sorted[i];
      const Chunk& b = *sorted[j];
      if (!a.offsets.empty() && b.offsets[0] >= a.offsets[0] + a.sizes[0]) break;
      SHOAL_CHECK_T(CheckpointError, !overlap(a, b), where, ": two chunks of '", entry.fqn, "' overlap");
    }
  }
}

// Refuses chunks that leave a tensor, overlap or leave part of it unwritten, naming `where`.
void check_chunks(TensorEntry& entry, const std::string& where) {
  const int64_t numel = element_count(entry, where);
  SHOAL_CHECK_T(CheckpointError, entry.chunks.size() <= kMaxChunks, where, ": '", entry.fqn, "' has ",
                entry.chunks.size(), " chunks, more than the ", kMaxChunks, " Shoal reads");
  for (auto& chunk : entry.chunks) check_inside(entry, chunk, where);
  check_disjoint(entry, where);
  int64_t covered = 0;  // disjoint parts of the tensor: at most its count
  for (const auto& chunk : entry.chunks) covered += chunk.numel;
  SHOAL_CHECK_T(CheckpointError, covered == numel, where, ": the chunks of '", entry.fqn, "' cover ",
                covered, " of its ", numel, " elements: some are missing");
}

// Refuses bytes that lie beyond their data file or are claimed by two chunks: so the tensors
// assembled hold no more than the files do.
void check_storage(const Metadata& metadata, const std::string& folder) {
  std::map<std::string, uint64_t> file_sizes;
  std::map<std::string, std::vector<std::pair<int64_t, int64_t>>> ranges;
  std::vector<std::pair<std::string, const StorageInfo*>> all;
  for (const auto& [key, info] : metadata.storage) all.emplace_back(key.first, &info);
  for (const auto& [name, info] : metadata.byte_storage) all.emplace_back(name, &info);
  for (const auto& [name, where] : all) {
    const StorageInfo& info = *where;
    const std::string path = folder + "/" + info.file;
    auto size = file_sizes.find(info.file);
    if (size == file_sizes.end()) {
      size = file_sizes.emplace(info.file, data::detail::require_regular_file<CheckpointError>(path)).first;
    }
    SHOAL_CHECK_T(CheckpointError, static_cast<uint64_t>(info.offset) <= size->second &&
                                       static_cast<uint64_t>(info.length) <= size->second - info.offset,
                  path, ": the bytes of '", name, "' (", info.length, " at ", info.offset,
                  ") lie beyond the end of the file (", size->second, " bytes): it is truncated");
    ranges[info.file].emplace_back(info.offset, info.length);
  }
  for (auto& [file, spans] : ranges) {
    std::sort(spans.begin(), spans.end());
    for (size_t i = 1; i < spans.size(); ++i) {
      SHOAL_CHECK_T(CheckpointError, spans[i - 1].first + spans[i - 1].second <= spans[i].first, folder,
                    "/", file, ": two chunks claim the same bytes (at ", spans[i].first,
                    "): the checkpoint's .metadata is damaged");
    }
  }
}

at::Tensor read_chunk(const TensorEntry& entry, const Chunk& chunk, const StorageInfo& info,
                      const std::string& folder, const LoadOptions& options) {
  const std::string path = folder + "/" + info.file;
  const uint64_t bytes = static_cast<uint64_t>(chunk.numel) * c10::elementSize(entry.dtype);
  SHOAL_CHECK_T(CheckpointError, bytes <= static_cast<uint64_t>(info.length), path, ": a chunk of '",
                entry.fqn, "' needs ", bytes, " bytes but its archive holds only ", info.length);
  const c10::IValue value = detail::load_torch_save_blob(path, info.offset, info.length, options);
  SHOAL_CHECK_T(CheckpointError, value.isTensor(), path, ": the bytes of '", entry.fqn, "' at ",
                info.offset, " hold a ", value.tagKind(), ", not a tensor");
  const at::Tensor tensor = value.toTensor();
  SHOAL_CHECK_T(CheckpointError, tensor.scalar_type() == entry.dtype, path, ": a chunk of '", entry.fqn,
                "' is ", dtype_name(tensor.scalar_type()), " but .metadata says ", dtype_name(entry.dtype));
  SHOAL_CHECK_T(CheckpointError, tensor.sizes().vec() == chunk.sizes, path, ": a chunk of '", entry.fqn,
                "' has size ", tensor.sizes(), " but .metadata says ", c10::IntArrayRef(chunk.sizes));
  return tensor;
}

at::Tensor assemble(const TensorEntry& entry, const Metadata& metadata, const std::string& folder,
                    const LoadOptions& options) {
  at::Tensor full = at::empty(entry.size, at::TensorOptions().dtype(entry.dtype).device(options.map_location));
  for (const auto& chunk : entry.chunks) {
    if (chunk.numel == 0) continue;
    auto info = metadata.storage.find({entry.fqn, chunk.offsets});
    SHOAL_CHECK_T(CheckpointError, info != metadata.storage.end(), folder, "/.metadata: the chunk of '",
                  entry.fqn, "' at ", c10::IntArrayRef(chunk.offsets),
                  " has no bytes in storage_data: the checkpoint is damaged");
    at::Tensor target = full;
    for (size_t d = 0; d < chunk.offsets.size(); ++d) {
      target = target.narrow(static_cast<int64_t>(d), chunk.offsets[d], chunk.sizes[d]);
    }
    target.copy_(read_chunk(entry, chunk, info->second, folder, options));
  }
  return full;
}

std::string read_whole(const std::string& path) {
  data::detail::require_regular_file<CheckpointError>(path);
  std::ifstream in(path, std::ios::binary);
  std::stringstream buffer;
  buffer << in.rdbuf();
  SHOAL_CHECK_T(CheckpointError, in.good() || in.eof(), path, ": cannot read");
  return buffer.str();
}

Metadata read_metadata(const std::string& folder, const LoadOptions& options) {
  const std::string path = folder + "/.metadata";
  const std::string pickle = read_whole(path);
  detail::UnpicklerLimits limits;
  limits.max_values = options.max_values;
  limits.max_container_bytes = options.max_container_bytes;
  limits.dcp_metadata = true;
  auto no_storage = [&path](const std::string&, c10::ScalarType, int64_t) -> at::Tensor {
    SHOAL_THROW(CheckpointError, path, ": holds a tensor; DCP's .metadata holds none");
  };
  const c10::IValue root = detail::Unpickler(pickle, no_storage, path, limits).load();
  Metadata metadata = MetadataReader(path).read(root);
  for (auto& entry : metadata.tensors) check_chunks(entry, path);
  check_storage(metadata, folder);
  return metadata;
}

}  // namespace

bool is_dcp_folder(const std::string& folder) {
  struct stat info {};
  return ::stat((folder + "/.metadata").c_str(), &info) == 0 && S_ISREG(info.st_mode);
}

DcpContents load_dcp(const std::string& folder, const LoadOptions& options) {
  const Metadata metadata = read_metadata(folder, options);
  DcpContents out;
  for (const auto& entry : metadata.tensors) out.tensors.insert(entry.fqn, assemble(entry, metadata, folder, options));
  out.skipped = metadata.bytes;
  return out;
}

std::optional<c10::IValue> load_dcp_object(const std::string& folder, const std::string& name,
                                           const LoadOptions& options) {
  const Metadata metadata = read_metadata(folder, options);
  auto it = metadata.byte_storage.find(name);
  if (it == metadata.byte_storage.end()) return std::nullopt;
  const std::string path = folder + "/" + it->second.file;
  return detail::load_torch_save_blob(path, it->second.offset, it->second.length, options);
}

std::optional<at::Tensor> load_dcp_tensor(const std::string& folder, const std::string& fqn,
                                          const LoadOptions& options) {
  const Metadata metadata = read_metadata(folder, options);
  for (const auto& entry : metadata.tensors) {
    if (entry.fqn == fqn) return assemble(entry, metadata, folder, options);
  }
  return std::nullopt;
}

std::map<std::string, c10::IValue> load_dcp_objects(const std::string& folder, const std::string& prefix,
                                                    const LoadOptions& options) {
  const Metadata metadata = read_metadata(folder, options);
  std::map<std::string, c10::IValue> out;
  for (const auto& [name, place] : metadata.byte_storage) {
    if (name.compare(0, prefix.size(), prefix) != 0) continue;
    out.emplace(name, detail::load_torch_save_blob(folder + "/" + place.file, place.offset, place.length, options));
  }
  return out;
}

}  // namespace shoal::checkpoint
