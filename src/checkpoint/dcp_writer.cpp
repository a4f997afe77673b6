#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include <dirent.h>

#include "checkpoint/atomic_file.h"
#include "checkpoint/dcp_metadata.h"
#include "checkpoint/pickle_opcodes.h"
#include "checkpoint/pickler.h"
#include "checkpoint/torch_save_writer.h"
#include "shoal/checkpoint/dcp.h"
#include "shoal/error.h"

namespace shoal::checkpoint::detail {
namespace {

constexpr const char* kMetadataModule = "torch.distributed.checkpoint.metadata";
constexpr const char* kDataFile = "__0_0.distcp";

// DCP's Metadata as Python's pickle writes its dataclasses: each object made with NEWOBJ from its
// class, then BUILD with its fields as a dict (TensorProperties: its __getstate__ tuple;
// BytesStorageMetadata, which has no fields: no BUILD).
class MetadataPickle : private PickleWriter {
 public:
  std::string write(const std::vector<DcpEntry>& entries) {
    op(op::kProto);
    op(2);
    object(kMetadataModule, "Metadata");
    begin_fields();
    push_string("state_dict_metadata");
    begin_dict();
    for (const auto& entry : entries) {
      push_string(entry.fqn);
      entry.bytes ? object(kMetadataModule, "BytesStorageMetadata") : tensor_metadata(entry);
    }
    op(op::kSetItems);
    push_string("planner_data");
    begin_dict();
    for (const auto& entry : entries) {
      push_string(entry.fqn);
      path(entry);
    }
    op(op::kSetItems);
    push_string("storage_data");
    begin_dict();
    for (const auto& entry : entries) {
      for (size_t i = 0; i < entry.chunks.size(); ++i) {
        index(entry, i);
        storage_info(entry.chunks[i]);
      }
    }
    op(op::kSetItems);
    push_string("version");
    push_string("1.0.0");
    end_fields();
    op(op::kStop);
    return bytes();
  }

 private:
  void object(const char* module, const char* cls) {
    push_global(module, cls);
    op(op::kEmptyTuple);
    op(op::kNewObj);
  }
  void begin_dict() {
    op(op::kEmptyDict);
    op(op::kMark);
  }
  void begin_fields() { begin_dict(); }
  void end_fields() {
    op(op::kSetItems);
    op(op::kBuild);
  }
  // torch.Size(dims)
  void size(c10::IntArrayRef dims) {
    push_global("torch", "Size");
    push_int_tuple(dims);
    op(op::kTuple1);
    op(op::kReduce);
  }
  // The key's place in the nested state dict: a tuple of names and list indices.
  void path(const DcpEntry& entry) {
    op(op::kMark);
    for (const auto& part : entry.path) {
      if (const auto* name = std::get_if<std::string>(&part)) {
        push_string(*name);
      } else {
        push_int(std::get<int64_t>(part));
      }
    }
    op(op::kTuple);
  }

  // TensorProperties(dtype, layout=strided, requires_grad=False, contiguous, pin_memory=False).
  void properties(c10::ScalarType dtype) {
    object(kMetadataModule, "TensorProperties");
    op(op::kMark);
    push_global("torch", dtype_name(dtype).c_str());
    push_global("torch.serialization", "_get_layout");
    push_string("torch.strided");
    op(op::kTuple1);
    op(op::kReduce);
    op(op::kNewFalse);
    push_global(kMetadataModule, "_MEM_FORMAT_ENCODING");
    push_int(0);  // TORCH_CONTIGUOUS_FORMAT
    op(op::kTuple1);
    op(op::kReduce);
    op(op::kNewFalse);
    op(op::kTuple);
    op(op::kBuild);
  }
  void tensor_metadata(const DcpEntry& entry) {
    object(kMetadataModule, "TensorStorageMetadata");
    begin_fields();
    push_string("properties");
    properties(entry.dtype);
    push_string("size");
    size(entry.size);
    push_string("chunks");
    op(op::kEmptyList);
    op(op::kMark);
    for (const auto& chunk : entry.chunks) {
      object(kMetadataModule, "ChunkStorageMetadata");
      begin_fields();
      push_string("offsets");
      size(chunk.offsets);
      push_string("sizes");
      size(chunk.sizes);
      end_fields();
    }
    op(op::kAppends);
    end_fields();
  }
  // MetadataIndex(fqn, offset, index): the chunk's offsets and its place in the chunk list; both
  // None for a bytes entry.
  void index(const DcpEntry& entry, size_t i) {
    object(kMetadataModule, "MetadataIndex");
    begin_fields();
    push_string("fqn");
    push_string(entry.fqn);
    push_string("offset");
    entry.bytes ? op(op::kNone) : size(entry.chunks[i].offsets);
    push_string("index");
    entry.bytes ? op(op::kNone) : push_int(static_cast<int64_t>(i));
    end_fields();
  }
  void storage_info(const DcpChunk& chunk) {
    object("torch.distributed.checkpoint.filesystem", "_StorageInfo");
    begin_fields();
    push_string("relative_path");
    push_string(chunk.file);
    push_string("offset");
    push_int(chunk.offset);
    push_string("length");
    push_int(chunk.length);
    end_fields();
  }
};

}  // namespace

std::string dcp_metadata_pickle(const std::vector<DcpEntry>& entries) {
  return MetadataPickle().write(entries);
}

// A DCP save never overwrites files a folder already holds.
void make_empty_folder(const std::string& folder) {
  if (::mkdir(folder.c_str(), 0755) == 0) return;
  SHOAL_CHECK_T(CheckpointError, errno == EEXIST, "cannot create the DCP folder ", folder, ": ",
                std::strerror(errno));
  DIR* dir = ::opendir(folder.c_str());
  SHOAL_CHECK_T(CheckpointError, dir != nullptr, folder,
                " exists and is not a folder; name a new folder for the DCP checkpoint");
  bool empty = true;
  while (const dirent* entry = ::readdir(dir)) {
    const std::string name = entry->d_name;
    if (name != "." && name != "..") empty = false;
  }
  ::closedir(dir);
  SHOAL_CHECK_T(CheckpointError, empty, folder,
                " is not empty; name a new or empty folder for the DCP checkpoint (nothing in it "
                "is overwritten)");
}

}  // namespace shoal::checkpoint::detail

namespace shoal::checkpoint {

void save_dcp(const StateDict& state, const std::string& folder) {
  detail::make_empty_folder(folder);
  std::vector<detail::DcpEntry> entries;
  {
    detail::TorchSaveSequence data(folder + "/" + detail::kDataFile);
    for (const auto& item : state) {
      const at::Tensor& tensor = item.value();
      const auto place = data.append(tensor.detach().to(at::kCPU).contiguous());
      // Every tensor one chunk covering all of it; its name its own path (a flat state dict).
      detail::DcpEntry entry;
      entry.fqn = item.key();
      entry.path = {item.key()};
      entry.dtype = tensor.scalar_type();
      entry.size = tensor.sizes().vec();
      entry.chunks.push_back({std::vector<int64_t>(entry.size.size(), 0), entry.size, detail::kDataFile,
                              place.offset, place.length});
      entries.push_back(std::move(entry));
    }
    data.commit();
  }
  detail::write_file_atomically(folder + "/.metadata", detail::dcp_metadata_pickle(entries));
}

}  // namespace shoal::checkpoint
