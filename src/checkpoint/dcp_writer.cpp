#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include <dirent.h>

#include "checkpoint/atomic_file.h"
#include "checkpoint/pickle_opcodes.h"
#include "checkpoint/pickler.h"
#include "checkpoint/torch_save_writer.h"
#include "shoal/checkpoint/dcp.h"
#include "shoal/error.h"

namespace shoal::checkpoint {
namespace {

namespace op = detail::op;

constexpr const char* kMetadataModule = "torch.distributed.checkpoint.metadata";
constexpr const char* kDataFile = "__0_0.distcp";

// Where one tensor's torch.save bytes lie in the data file.
struct ItemLocation {
  int64_t offset = 0;
  int64_t length = 0;
};

// DCP's Metadata as Python's pickle writes its dataclasses: each object made with NEWOBJ from its
// class, then BUILD with its fields as a dict (TensorProperties: its __getstate__ tuple). Every
// tensor is one chunk covering all of it, at offset 0, index 0.
class MetadataPickle : private detail::PickleWriter {
 public:
  std::string write(const StateDict& state, const std::vector<ItemLocation>& where) {
    op(op::kProto);
    op(2);
    object(kMetadataModule, "Metadata");
    begin_fields();
    push_string("state_dict_metadata");
    begin_dict();
    for (const auto& item : state) {
      push_string(item.key());
      tensor_metadata(item.value());
    }
    op(op::kSetItems);
    push_string("planner_data");  // each name's path in the saved (flat) state dict: itself
    begin_dict();
    for (const auto& item : state) {
      push_string(item.key());
      push_string(item.key());
      op(op::kTuple1);
    }
    op(op::kSetItems);
    push_string("storage_data");
    begin_dict();
    for (size_t i = 0; i < state.size(); ++i) {
      index(state[i].key(), state[i].value().dim());
      storage_info(where[i]);
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
  void zeros(int64_t dims) { size(std::vector<int64_t>(static_cast<size_t>(dims), 0)); }

  // TensorProperties(dtype, layout=strided, requires_grad=False, contiguous, pin_memory=False).
  void properties(const at::Tensor& tensor) {
    object(kMetadataModule, "TensorProperties");
    op(op::kMark);
    push_global("torch", dtype_name(tensor.scalar_type()).c_str());
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
  void tensor_metadata(const at::Tensor& tensor) {
    object(kMetadataModule, "TensorStorageMetadata");
    begin_fields();
    push_string("properties");
    properties(tensor);
    push_string("size");
    size(tensor.sizes());
    push_string("chunks");
    op(op::kEmptyList);
    object(kMetadataModule, "ChunkStorageMetadata");
    begin_fields();
    push_string("offsets");
    zeros(tensor.dim());
    push_string("sizes");
    size(tensor.sizes());
    end_fields();
    op(op::kAppend);
    end_fields();
  }
  void index(const std::string& fqn, int64_t dims) {
    object(kMetadataModule, "MetadataIndex");
    begin_fields();
    push_string("fqn");
    push_string(fqn);
    push_string("offset");
    zeros(dims);
    push_string("index");
    push_int(0);
    end_fields();
  }
  void storage_info(const ItemLocation& where) {
    object("torch.distributed.checkpoint.filesystem", "_StorageInfo");
    begin_fields();
    push_string("relative_path");
    push_string(kDataFile);
    push_string("offset");
    push_int(where.offset);
    push_string("length");
    push_int(where.length);
    end_fields();
  }
};

// Makes `folder` (one level), or accepts it when it exists and is empty: a DCP save never
// overwrites files a folder already holds.
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

}  // namespace

void save_dcp(const StateDict& state, const std::string& folder) {
  make_empty_folder(folder);
  std::vector<ItemLocation> where;
  {
    const std::string path = folder + "/" + kDataFile;
    detail::AtomicFile data(path);
    int64_t written = 0;
    auto sink = [&](const void* bytes, size_t size) {
      const size_t taken = data.append(bytes, size);
      written += static_cast<int64_t>(taken);
      return taken;
    };
    for (const auto& item : state) {
      const int64_t start = written;
      detail::write_torch_save(item.value().detach().to(at::kCPU).contiguous(), sink, path);
      where.push_back({start, written - start});
    }
    data.commit();
  }
  detail::write_file_atomically(folder + "/.metadata", MetadataPickle().write(state, where));
}

}  // namespace shoal::checkpoint
